"""Lightning callbacks for straggler experiments: inject imbalance, track staleness.

Neither callback issues a collective: both act and log per rank.
"""

from lightning_partial.callbacks.load_imbalance import ImbalanceRecord, LoadImbalance, draw_stragglers
from lightning_partial.callbacks.staleness import StalenessSummary, StalenessTracker

__all__ = ["ImbalanceRecord", "LoadImbalance", "StalenessSummary", "StalenessTracker", "draw_stragglers"]
