"""Tinker's training API served by rollouts (`rollouts tinker-serve`, docs/tinker.md).

wire.py (protobuf in/out), losses.py (Tinker's losses and input checks), trainer.py (one
model on a PyTorchTrainingBackend), futures.py (futures and seq_id order), service.py (models,
sessions, paths, sampling), routes.py (HTTP), serve.py (CLI and `open_tinker_server`).
"""
