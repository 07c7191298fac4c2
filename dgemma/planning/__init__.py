"""Planning and launching (above `dgemma.train`, below the CLI): will a run fit, and how is it started.

Package data: `templates/` (job templates), `profiles/` (example launch profiles), `hardware/` (env per
accelerator), `gpu_targets/` (the H100 target description for deviceless compiles). Importing this package imports
nothing heavy; import the submodules you need.

Modules:
  planner          per-device memory and FLOPs of a training step from abstract shapes (docs/planner.md)
  plan_config      the planner on a RunConfig: `PlanSpec`, the text report, XLA's compiled memory analysis
  flops            FLOPs per token, per forward and per optimizer step, as implemented
  layer_bytes      bytes per token one layer keeps for the backward pass, every Gemma 4 family member
  expert_parallel  expert-parallel MoE terms: collective bytes and transient expert weights per device
  sdrl_plan        stage 2 (SD·RL) in the planner: memory and FLOPs of one iteration
  lora_plan        adapters in the planner: what changes when only low-rank adapters train
  accelerators     the accelerators the planner knows (HBM, peak FLOPs, devices and RAM per host)
  device_memory    `dgemma train`'s own accelerator memory setup and fit check before the first step
  gpu_aot          deviceless XLA:GPU compiles: memory analysis of a step for H100s without one
  tpu_aot          deviceless TPU compiles: the TPU compiler's memory analysis without a TPU
  sampler_aot      compile the sampler's per-block program with abstract inputs
  golden           golden PartitionSpec tables (`python -m dgemma.planning.golden --check --dir DIR`)
  launch_spec      launch settings (profiles), independent of the run config
  launcher         render / submit local | slurm | xpk | tpu-vm jobs
  rehearse         the full-shape CPU rehearsal of a shipped run config (docs/rehearsal.md)
  rehearse_phases  the rehearsal's phases, each through the CLI as child processes
  rehearse_check   the rehearsal's checks that need a backend, as child processes
"""
