"""Tensor parallelism: one model split across N ranks, each holding a slice of every
layer's heads and MLP columns and of the vocabulary, its KV cache holding its own heads.

The engine core stays single (one scheduler, one block manager). Rank 0 is the core's own
model runner, the leader (`leader.Ranks`): each block move and forward it runs, it first
sends to ranks 1..N-1 (`follower`, one process each), which run the same step on their
shards; the layers' all-reduces and the logits' gather go through torch.distributed
(`group.TensorParallel`: gloo on the CPU, NCCL on CUDA). Only rank 0 samples.
"""
