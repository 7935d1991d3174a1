"""Tensor parallelism on torch.distributed: one engine across the GPUs of a worker (NCCL; gloo on CPU).

Rank 0 is the engine process: scheduler, tokenizer, sampler, handler. Every other rank is a process it spawns
(worker.py) that holds a shard of the model and its own KV pool, and replays rank 0's forward passes from a small
pickled step descriptor (group.py). shard.py says which rows and columns of each weight a rank keeps."""
