"""Ranking losses for deep metric learning: FastAP, Smooth-AP, Ranked List Loss and the triplet hinge.

All share `RankingLoss`'s call convention (`loss(embeddings, labels)`, an optional explicit gallery via
`ref_embeddings`, `ref_labels`, `query_index`, and `parts()` for the distributed engine).
"""

from dmltrain.losses.base import LossParts, RankingLoss
from dmltrain.losses.fastap import FastAPLoss
from dmltrain.losses.levelwise import LevelwiseLoss
from dmltrain.losses.ranked_list import RankedListLoss, TnSchedule
from dmltrain.losses.smoothap import SmoothAPLoss
from dmltrain.losses.triplet import TripletLoss

__all__ = [
    "FastAPLoss",
    "LevelwiseLoss",
    "LossParts",
    "RankedListLoss",
    "RankingLoss",
    "SmoothAPLoss",
    "TnSchedule",
    "TripletLoss",
]
