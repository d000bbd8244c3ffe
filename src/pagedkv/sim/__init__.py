"""Memory planner and KV allocation simulator (standard library only: no torch, no numpy).

`pagedkv plan` answers how much KV cache a model leaves on a GPU; `pagedkv simulate` replays
a workload against contiguous and paged allocation policies on a simulated clock.
"""
