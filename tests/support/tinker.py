"""Data for the Tinker API's tests, in the `tinker` SDK's types, and where the server keeps sampler
weights and training checkpoints."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import load_file
from tinker import types

from gateway.tinker.paths import SEGMENT, checkpoint_key, parse_tinker_path

ADAPTER = "adapter_model.safetensors"
"""The LoRA tensors' file in a checkpoint's folder."""


def datum(tokens: list[int]) -> types.Datum:
    """Next-token prediction on `tokens`, every target weighted 1."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def sampler_versions(blob_dir: Path, org_id: str, sampler_path: str) -> list[Path]:
    """The folders of the versions saved under the sampler name of `sampler_path` (a `tinker://` path), the
    newest last: the server keeps each version's files in a folder of its own."""
    parsed = parse_tinker_path(sampler_path)
    assert parsed is not None and parsed[1] == "sampler", sampler_path
    folder = blob_dir / checkpoint_key(org_id, parsed[0], SEGMENT["sampler"], parsed[2])
    return sorted((p for p in folder.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)


def sampler_folder(blob_dir: Path, org_id: str, sampler_path: str) -> Path:
    """The folder of the newest version saved under the sampler name of `sampler_path`."""
    return sampler_versions(blob_dir, org_id, sampler_path)[-1]


def assert_saved_adapter(blob_dir: Path, org_id: str, state_path: str, want: dict[str, np.ndarray]) -> None:
    """The LoRA tensors of the training checkpoint at `state_path` (a `tinker://` path from `save_state`), as
    the server stored them, are `want`'s (to 1e-6)."""
    parsed = parse_tinker_path(state_path)
    assert parsed is not None, state_path
    model_id, _, name = parsed
    adapter = load_file(blob_dir / checkpoint_key(org_id, model_id, SEGMENT["training"], name) / ADAPTER)
    assert adapter.keys() == want.keys()
    for key, value in adapter.items():
        np.testing.assert_allclose(value, want[key], atol=1e-6, err_msg=key)
