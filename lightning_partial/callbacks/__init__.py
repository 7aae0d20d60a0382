"""Lightning callbacks for straggler experiments: inject imbalance, track staleness, rotate groups.

No callback issues a collective: each acts and logs per rank.
"""

from lightning_partial.callbacks.adaptive_batch_size import AdaptiveBatchSize
from lightning_partial.callbacks.group_rotation import GroupRecord, GroupRotation
from lightning_partial.callbacks.load_imbalance import ImbalanceRecord, LoadImbalance, draw_stragglers
from lightning_partial.callbacks.staleness import StalenessSummary, StalenessTracker

__all__ = ["AdaptiveBatchSize", "GroupRecord", "GroupRotation", "ImbalanceRecord", "LoadImbalance", "StalenessSummary", "StalenessTracker", "draw_stragglers"]
