"""Input dist and output dist (docs/design.md's step 1 and 3): ids routed to their shards' ranks,
pooled columns routed back.

Input dist checks a batch (`checks`), routes each id to the rank holding its row (`router`,
`permute`) and exchanges the ids in one all-to-all with their header (`exchange`), optionally
ahead of time on a background thread (`prefetcher`); output dist sends the pooled columns back
and lays them out as the unsharded module's output (`arrival`). The collectives themselves are free functions in
modular/comm.py.
"""
