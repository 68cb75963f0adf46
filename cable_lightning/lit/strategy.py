"""FSDP2 for the sharded recipe: Lightning's ModelParallelStrategy with every process one data-parallel shard.

Lightning 2.6's ``FSDPStrategy`` (FSDP1) refuses the CPU, and torch's FSDP1 wants an accelerator; FSDP2
(``fully_shard``) runs on CPU over gloo as well as on GPUs over NCCL, so the same recipe is tested before a GPU
run. The sharding itself is the module's (:meth:`LanguageModel.configure_model`: per block, then the rest).
"""

from __future__ import annotations

from lightning.pytorch.strategies import ModelParallelStrategy


class FSDP2Strategy(ModelParallelStrategy):
    """Fully sharded data parallel over every process (no tensor parallelism), whatever ``devices`` and
    ``num_nodes`` are. ``save_distributed_checkpoint=False`` (the default here) writes the ordinary single-file
    checkpoint, full weights and optimizer state gathered on rank 0, which ``validate``, ``export`` and
    ``--ckpt_path`` read in one process; ``True`` writes torch.distributed.checkpoint folders, one file per rank
    (faster to save for very large models; resume only, with the same strategy)."""

    def __init__(self, save_distributed_checkpoint: bool = False, process_group_backend: str | None = None):
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend)

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # Lightning's "auto" would be num_nodes
        super().setup_environment()
