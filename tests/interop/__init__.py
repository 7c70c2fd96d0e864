"""TorchRec interop at run time: DistributedModelParallel under plans converted by `planners.to_torchrec`."""
