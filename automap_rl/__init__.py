"""automap_rl: find sharding plans for JAX programs by search over a partitioning IR.

This package is the library core (IR, meshes, sharding, simulator, XLA, workloads,
tactics). The environments (`envs`), the agents and the `partition(...)` facade
(`agents`), and the command line (`experiments`) build on it:
`from agents import partition`.
"""
