"""`python -m trainer.tinker_session`: one LoRA training model of the Tinker API, held for its whole life.

The worker starts one such process per training model and sends it requests one at a time, in the order the
client issued them, as JSON lines on stdin; each gets one JSON line on stdout: `{"ok": true, "result": ...}`
or `{"ok": false, "error": message, "category": "user" | "server"}`. Logs go to stderr. The process knows
nothing of the database or the queue: the worker reads the requests and writes the results.

Requests (`op`):
- `init`: `base_path`, `rank`, `seed`, `train_attn`, `train_mlp`: load the base model and add a fresh LoRA
  adapter (PEFT, alpha 32, no dropout) on the attention and/or MLP projections.
- `forward_backward`: `loss_fn`, `loss_fn_config`, `forward_only`, `data` (each `{"tokens": [...],
  "inputs": {name: [...]}}`): per-token log-probabilities of `target_tokens`, the loss
  (`trainer.tinker_losses`), and, unless `forward_only`, its gradient added to the adapter's. The gateway
  checks the data first (`gateway.tinker.wire`); what still does not fit here (a token id the model has no
  row for, a value that is not a finite number) is the caller's error, never a crash of the model's device.
- `optim_step`: Adam's `learning_rate`, `beta1`, `beta2`, `eps`, `weight_decay`, `grad_clip_norm`: one
  AdamW step with these values, then the gradients are cleared.
- `save_state` / `load_state`: `dir`, `optimizer`, `grads`: the adapter (and the optimizer's state) to or
  from `dir` (`optimizer: "if_saved"` loads the optimizer's state when the directory holds one). With
  `grads`, also the gradients accumulated since the last `optim_step` (none when there are none): the
  worker's own saves of a model it lets go, whose next process must step exactly as this one would have.
  A user's checkpoint holds none, as Tinker's do not.
- `save_sampler`: `dir`: the adapter alone in PEFT's layout, which is vLLM's LoRA contract.

On CUDA the model runs in bfloat16, on the CPU in float32; the code is the same.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from trainer.tinker_losses import LossInputError, check_loss, per_token_loss

logger = logging.getLogger(__name__)

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_ALPHA = 32
OPTIMIZER_FILE = "optimizer.pt"
GRADS_FILE = "gradients.safetensors"


class Session:
    """The model, its adapter and its optimizer."""

    def __init__(self, req: dict[str, Any]) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        base = AutoModelForCausalLM.from_pretrained(req["base_path"], dtype=dtype)
        base = base.to(self.device)  # type: ignore[arg-type]  # transformers' stub of .to
        # token ids each end of the model has rows for (the forward checks a request's ids against them)
        self.input_rows = int(base.get_input_embeddings().num_embeddings)
        head = base.get_output_embeddings()
        self.output_rows = int(head.out_features) if head is not None else self.input_rows
        present = {name.rsplit(".", 1)[-1] for name, _ in base.named_modules()}
        wanted = (ATTN_MODULES if req.get("train_attn", True) else ()) + (
            MLP_MODULES if req.get("train_mlp", True) else ()
        )
        targets = [m for m in wanted if m in present]
        if not targets:
            raise LossInputError("No layer to train: enable train_attn or train_mlp.")
        if req.get("seed") is not None:
            torch.manual_seed(int(req["seed"]))
        config = LoraConfig(
            r=int(req["rank"]), lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=targets,
            bias="none", task_type="CAUSAL_LM",
        )  # fmt: skip
        self.model = get_peft_model(base, config)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer: Any = None

    def _optimizer(self) -> Any:
        if self.optimizer is None:
            self.optimizer = self.torch.optim.AdamW(self.params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12)
        return self.optimizer

    def forward_backward(self, req: dict[str, Any]) -> dict[str, Any]:
        torch = self.torch
        loss_fn = req["loss_fn"]
        check_loss(loss_fn)
        config = req.get("loss_fn_config") or {}
        outputs: list[dict[str, list[float]]] = []
        total = 0.0
        tokens = 0
        for i, datum in enumerate(req["data"]):
            ids = self._token_ids(datum["tokens"], f"data[{i}].model_input", self.input_rows)
            inputs = datum["inputs"]
            if "target_tokens" not in inputs:
                raise LossInputError(f"data[{i}] has no loss_fn_input 'target_tokens'.")
            target = self._token_ids(
                inputs["target_tokens"], f"data[{i}].loss_fn_inputs.target_tokens", self.output_rows
            )
            if len(target) != len(ids):
                raise LossInputError(
                    f"data[{i}]: target_tokens has {len(target)} entries for {len(ids)} input tokens."
                )
            floats = {
                k: self._floats(v, f"data[{i}].loss_fn_inputs.{k}")
                for k, v in inputs.items()
                if k != "target_tokens"
            }
            for k, v in floats.items():
                if v.numel() != len(ids):
                    raise LossInputError(f"data[{i}]: {k} has {v.numel()} entries for {len(ids)} tokens.")
            with torch.set_grad_enabled(not req.get("forward_only")):
                x = ids[None, :]
                logits = self.model(input_ids=x).logits[0].float()
                logprobs = torch.log_softmax(logits, dim=-1).gather(-1, target[:, None])[:, 0]
                loss = per_token_loss(loss_fn, logprobs, floats, config)
                if not req.get("forward_only"):
                    loss.sum().backward()
            total += float(loss.detach().sum())
            tokens += len(ids)
            outputs.append(
                {
                    "logprobs": logprobs.detach().cpu().tolist(),
                    "elementwise_loss": loss.detach().cpu().tolist(),
                }
            )
        return {"outputs": outputs, "metrics": {"loss:sum": total}, "tokens": tokens}

    def _token_ids(self, values: Any, field: str, rows: int) -> Any:
        """`values` as a 1-D tensor of token ids below `rows`. Checked here too, not only by the gateway
        (which may not know the vocabulary): an id out of range is an IndexError on the CPU and a
        device-side assert, which loses the process's CUDA context, on a GPU."""
        torch = self.torch
        try:
            ids = torch.tensor(values, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise LossInputError(f"{field} must be a list of token ids.") from None
        if ids.dim() != 1 or not len(ids):
            raise LossInputError(f"{field} must be a non-empty list of token ids.")
        if int(ids.min()) < 0 or int(ids.max()) >= rows:
            raise LossInputError(f"{field} holds a token id out of the model's vocabulary (0 to {rows - 1}).")
        return ids.to(self.device)

    def _floats(self, values: Any, field: str) -> Any:
        """`values` as a float tensor of finite numbers (a NaN sent as JSON arrives as null)."""
        torch = self.torch
        try:
            out = torch.tensor(values, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise LossInputError(f"{field} must be a list of numbers.") from None
        if not bool(torch.isfinite(out).all()):
            raise LossInputError(f"{field} holds NaN or infinity; give finite numbers.")
        return out.to(self.device)

    def optim_step(self, req: dict[str, Any]) -> dict[str, Any]:
        opt = self._optimizer()
        for group in opt.param_groups:
            group["lr"] = float(req.get("learning_rate", 1e-4))
            group["betas"] = (float(req.get("beta1", 0.9)), float(req.get("beta2", 0.95)))
            group["eps"] = float(req.get("eps", 1e-12))
            group["weight_decay"] = float(req.get("weight_decay", 0.0))
        norm = self.torch.nn.utils.clip_grad_norm_(
            self.params, float(req["grad_clip_norm"]) if req.get("grad_clip_norm") else float("inf")
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"metrics": {"grad_norm:mean": float(norm)}}

    def save_state(self, req: dict[str, Any]) -> dict[str, Any]:
        out = Path(req["dir"])
        self.model.save_pretrained(str(out))
        if req.get("optimizer", True) and self.optimizer is not None:
            # AdamW's moments and its step count (the bias correction of the next step depends on it)
            self.torch.save(self.optimizer.state_dict(), out / OPTIMIZER_FILE)
        if req.get("grads"):
            self._save_grads(out / GRADS_FILE)
        return {"size_bytes": _size(out)}

    def _trainable(self) -> dict[str, Any]:
        """The adapter's parameters by name: the same names in every process of the same config."""
        return {name: p for name, p in self.model.named_parameters() if p.requires_grad}

    def _save_grads(self, path: Path) -> None:
        """The gradients `forward_backward` added since the last `optim_step`, if any (`optim_step` clears
        them to None, so a file means work not yet stepped)."""
        from safetensors.torch import save_file

        grads = {
            name: p.grad.detach().contiguous() for name, p in self._trainable().items() if p.grad is not None
        }
        if grads:
            save_file(grads, str(path))

    def _load_grads(self, path: Path) -> None:
        """Set the gradients saved by `_save_grads`; without the file there were none to carry over."""
        from safetensors.torch import load_file

        params = self._trainable()
        for p in params.values():
            p.grad = None
        if not path.exists():
            return
        grads = load_file(str(path), device=self.device)
        if not grads.keys() <= params.keys():
            raise RuntimeError(f"{path} holds gradients of other parameters than this model's adapter.")
        for name, grad in grads.items():
            params[name].grad = grad.to(params[name].dtype)

    def load_state(self, req: dict[str, Any]) -> dict[str, Any]:
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        src = Path(req["dir"])
        weights = load_file(str(src / "adapter_model.safetensors"), device=self.device)
        set_peft_model_state_dict(self.model, weights)
        self.optimizer = None
        state = src / OPTIMIZER_FILE
        if req.get("optimizer") == "if_saved":  # a resumed model: its optimizer, if it had stepped
            req["optimizer"] = state.exists()
        if req.get("optimizer"):
            if not state.exists():
                raise LossInputError("This checkpoint was saved without optimizer state.")
            self._optimizer().load_state_dict(self.torch.load(state, map_location=self.device))
        if req.get("grads"):
            self._load_grads(src / GRADS_FILE)
        return {}

    def save_sampler(self, req: dict[str, Any]) -> dict[str, Any]:
        out = Path(req["dir"])
        self.model.save_pretrained(str(out))
        return {"size_bytes": _size(out)}


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def serve(stdin: Any, stdout: Any) -> None:
    """Answer requests until stdin closes."""
    session: Session | None = None
    for line in stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            if req["op"] == "init":
                session = Session(req)
                result: dict[str, Any] = {}
            else:
                assert session is not None, "the first request must be init"
                result = getattr(session, req["op"])(req)
            reply: dict[str, Any] = {"ok": True, "result": result}
        except (LossInputError, FileNotFoundError) as exc:
            reply = {"ok": False, "error": str(exc), "category": "user"}
        except Exception as exc:  # noqa: BLE001 — any failure is this request's answer, the process lives on
            logger.error("request %s failed:\n%s", req.get("op"), traceback.format_exc())
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "category": "server"}
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    out = sys.stdout
    sys.stdout = sys.stderr  # library prints must not reach the replies
    serve(sys.stdin, out)


if __name__ == "__main__":
    main()
