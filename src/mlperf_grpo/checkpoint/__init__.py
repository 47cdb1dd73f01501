"""Deferred checkpoints: each ``step_N/`` a complete Hugging Face model directory.

``format`` (layout, ``training_info.json``), ``writer`` (asynchronous writes and
publish, on every rank), ``staging`` (the host staging copy and its checksums), ``shard_plan`` (which rank writes which tensors, in which file),
``rank_group`` (the ranks' reports to rank 0 through the store), ``engine_weights`` (what
a rank stages from its engine), ``direct_io`` (shard files written with O_DIRECT from
aligned memory), ``reader``
(discovery, header and file checks, verified reads), ``foreign`` (other trainers' layouts),
``hf_index`` (which files of their Hugging Face directories hold the weights)
and ``dcp_read`` (their torch distributed checkpoints, read in one process).
"""

from mlperf_grpo.checkpoint.format import (
    END_FILE,
    HASH_ALGORITHM,
    INDEX_FILE,
    INFO_FILE,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointWriteError,
    TrainingEnd,
    TrainingInfo,
    sha256_file,
)
from mlperf_grpo.checkpoint.reader import (
    Checkpoint,
    check_model_files,
    check_same_tensors,
    discover_checkpoints,
    discover_series,
    read_training_end,
    read_training_info,
    read_weights,
    remove_checkpoints,
    tensor_specs,
)
from mlperf_grpo.checkpoint.writer import AsyncCheckpointer, CheckpointTiming, write_checkpoint
from mlperf_grpo.checkpoint.engine_weights import engine_checkpoint_weights
from mlperf_grpo.checkpoint.rank_group import RankGroup
from mlperf_grpo.step_dirs import published_steps


__all__ = [
    "END_FILE", "HASH_ALGORITHM", "INDEX_FILE", "INFO_FILE", "AsyncCheckpointer", "Checkpoint",
    "CheckpointCorruptError", "CheckpointError", "CheckpointTiming", "CheckpointWriteError", "RankGroup", "TrainingEnd",
    "TrainingInfo", "check_model_files", "check_same_tensors", "discover_checkpoints", "discover_series", "published_steps", "read_training_end",
    "read_training_info", "read_weights", "remove_checkpoints", "sha256_file", "tensor_specs",
    "engine_checkpoint_weights", "write_checkpoint",
]
