"""Pipeline parallelism: the target's layers split into stages across processes and machines.

`stage_model.StageLM` is one stage's part of the model; `link.StageLink` moves commands, hidden
states and results between stages; `batch_queue.PipelinedEngine` keeps up to `pp`
micro-batches in flight. The process groups are in `specserve.distributed`, the launcher and
worker loop in `specserve.model.tp_worker`, and the driving runner in
`specserve.model.runner`, shared with tensor parallelism.
"""
