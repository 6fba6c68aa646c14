"""`rollouts launch`: a Slurm batch script and Kubernetes manifests for an RL run on a cluster.

Layers: `spec` (the cluster description, validated) under `slurm` and `k8s` (rendering, no
I/O), `k8s_schema` (a structural check of the manifests), `cli` (files, `sbatch`). Torch-free.
"""
