"""tunegate: trainer -- the training runtime. One job = one process: spec in, JSON-lines events out.

- ``python -m trainer run SPEC.json``: SFT (``supervised``), ``dpo`` or GRPO (``reinforcement``) with a LoRA
  adapter on a Hugging Face base model (``trainer.run.main``, spec in ``trainer.contract.TrainerSpec``, events
  in ``trainer.events``).
- ``python -m trainer make-tiny DIR``: the tiny offline chat model (``trainer.tiny.make_tiny_model``).
- ``trainer.rewards``: TRL reward functions from OpenAI graders (``envsdk.graders``) and environments.

Nothing here knows about Postgres or Redis; the only package it may import is ``envsdk``.
"""
