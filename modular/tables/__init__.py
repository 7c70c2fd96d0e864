"""From a plan to this rank's shards: the layout of routes and outputs (`layout`), the tables'
weights as `ShardedTensor`s under their unsharded names (`weights`), and filling the shards
(`init`). Pure construction: nothing here runs in a training step."""
