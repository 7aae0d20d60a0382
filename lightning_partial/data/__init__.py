"""Data helpers for the strategies."""

from lightning_partial.data.elastic import ElasticBatchSampler

__all__ = ["ElasticBatchSampler"]
