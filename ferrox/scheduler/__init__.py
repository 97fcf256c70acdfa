"""ferrox.scheduler: pure arithmetic of admission, chunked prefill, pages and prefix caching.

No torch, no ray: everything here runs and is tested without a GPU.
"""

from .admission import (
    RECURRENT_SLOTS_PER_REQUEST,
    AdmittedChunk,
    Capacity,
    ChunkState,
    DecodeSet,
    DecodingRequest,
    FinishReason,
    Geometry,
    NotAdmitted,
    PendingRequest,
    PrefillPass,
    PromptAdmission,
    SlotTable,
    align_ceil,
    align_down,
    finish_reason,
)
from .core import ScheduledSeq, ScheduledStep, Scheduler, SchedulerConfig
from .kv import KVManager
from .pages import CACHE_OWNER, OutOfPages, PageAllocator
from .planner import DecodeStep, IdleStep, PrefillStep, PrefixHit, RequestRefused, StepPlanner
from .radix import PrefixMatch, RadixCache, page_hashes

__all__ = [name for name in dir() if not name.startswith("_")]
