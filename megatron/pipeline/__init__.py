"""The pipeline runtime: runs the programs of `megatron.schedules` on real processes.

Assembly from a typed `PipelineConfig`, the executor that interprets one rank's program,
point-to-point transfers, per-backward-stage modules and owners, and node replicas.
"""
