"""Input dist (docs/design.md's step 1): the ids' way in, from a rank's batch to the ranks that
hold their rows.

A batch is checked (`checks`), each id routed to the rank holding its row (`router`, `permute`;
`variable_batch` for torchrec's VBE KJTs, whose features have their own bag counts) and the ids
exchanged in one all-to-all with their header (`exchange`), optionally ahead of time on a
background thread (`prefetcher`); `received` is what the input dist hands to lookup and output
dist. The way back (output dist) is each kind's: modular/pooled/ and modular/sequence/. The
collectives themselves are free functions in modular/comm.py.
"""
