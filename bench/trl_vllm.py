"""GRPO generating with vLLM (TRL's `use_vllm`) against generating with transformers' `generate`, on the
quickstart's kind of run.

The run: `tiny-chat` (`python -m trainer make-tiny DIR`) on the arithmetic example's 70 training problems,
rewarded as the example environment rewards them (1 for exactly the number, 0.5 for a text holding it, 0.1
for any digits), with the quickstart's hyperparameters (8 prompts x 8 answers a step, 16 tokens, learning
rate 5e-4, LoRA r 8 on all linear layers), judged on the 30 held-out problems (greedy exact answers with
transformers). One mode a process, from the repository root (`-m`: run as a script, `bench/profile.py` would
shadow the standard library's `profile`, which torch imports):

    python -m bench.trl_vllm MODEL_DIR OUT.json --mode generate         # transformers' generate
    python -m bench.trl_vllm MODEL_DIR OUT.json --mode colocate         # vLLM in the trainer's process
    python -m bench.trl_vllm MODEL_DIR OUT.json --mode colocate-reload  # the same, synced by reload_weights
    python -m bench.trl_vllm MODEL_DIR OUT.json --mode server --port P  # a vLLM server with TRL's flags

It imports neither tunegate nor vLLM itself, so it runs in any venv with TRL and PEFT. The vLLM modes need
vLLM importable beside TRL, which the project's venv cannot hold (vLLM pins transformers below the project's
pin). A venv that borrows `.venv-vllm`'s packages without changing it does:

    python3 -m venv /tmp/trlvllm
    echo "$PWD/.venv-vllm/lib/python3.11/site-packages" > /tmp/trlvllm/lib/python3.11/site-packages/vllm.pth
    /tmp/trlvllm/bin/pip install trl==1.16.0 peft accelerate datasets
    /tmp/trlvllm/bin/pip uninstall -y setuptools   # vLLM pins its own, found through the .pth file

It writes the step times, the seconds of each block TRL profiles (generation, weight syncs, the loss), the
reward per step and the held-out exact rate to OUT.json. Measured outcome: docs/training.md, "Generation
with vLLM during training".
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ARITHMETIC = Path(__file__).resolve().parents[1] / "examples" / "envs" / "arithmetic"
NUMBER = re.compile(r"-?\d+")
HYPERPARAMETERS: dict[str, Any] = {
    "batch_size": 8,
    "num_generations": 8,
    "max_completion_length": 16,
    "learning_rate": 5e-4,
    "lora_r": 8,
    "lora_alpha": 16,
    "temperature": 1.0,
}
"""What the quickstart's job resolves its "auto" hyperparameters to for tiny-chat."""
MODES = ("generate", "colocate", "colocate-reload", "server")


def _rows(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (ARITHMETIC / name).read_text().splitlines() if line.strip()]


def _reward(text: str, answer: str) -> float:
    """The arithmetic example environment's reward (with partial credit)."""
    text, answer = text.strip(), answer.strip()
    if text == answer:
        return 1.0
    numbers = NUMBER.findall(text)
    if answer in numbers:
        return 0.5
    return 0.1 if numbers else 0.0


def arithmetic_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float | None]:
    """TRL reward function: the environment's reward of each completion (chat or plain text)."""
    texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
    return [_reward(t, a) for t, a in zip(texts, answer, strict=True)]


def heldout_exact(model_dir: str, adapter: Path) -> tuple[float, list[str]]:
    """Greedy exact-match rate of the adapter on the held-out problems, and its answers."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = _rows("heldout.jsonl")
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model: Any = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(adapter))
    model.eval()
    prompts = [
        tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True) for r in rows
    ]
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=16, do_sample=False)
    answers = [
        a.strip() for a in tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    ]
    exact = sum(a == str(r["answer"]) for a, r in zip(answers, rows, strict=True)) / len(rows)
    return exact, answers


def _sync_by_reload() -> None:
    """Make TRL's colocated weight sync use vLLM's in-place `reload_weights` (which restores each layer's
    loading layout, loads, and packs again) instead of `model.load_weights`, which the CPU build cannot take
    once it has packed the linear layers' weights for its GEMM kernels and dropped the originals."""
    from trl.generation.vllm_generation import VLLMGeneration

    def sync_weights(self: Any) -> None:
        weights = [(name, param.detach().clone()) for name, param in self._iter_named_params()]
        runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
        runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        self.llm.reset_prefix_cache()

    VLLMGeneration.sync_weights = sync_weights  # type: ignore[method-assign]


def _collect_profiling() -> dict[str, list[float]]:
    """The seconds of each block TRL profiles (`sync_weights`, `vLLM.generate`, `transformers.generate`,
    the loss, ...), by name: TRL only sends them to wandb, mlflow or trackio, so they are kept here too."""
    from trl.extras.profiling import ProfilingContext

    seen: dict[str, list[float]] = {}
    log = ProfilingContext._log_metrics

    def keep(self: Any, duration: float) -> None:
        seen.setdefault(self.name.split(".", 1)[-1], []).append(duration)
        log(self, duration)

    ProfilingContext._log_metrics = keep  # type: ignore[method-assign]
    return seen


def run(model_dir: str, out_dir: Path, mode: str, steps: int, seed: int, port: int) -> dict[str, Any]:
    """One GRPO run of `steps` steps generating by `mode`; its timings and what it learned."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    hp = HYPERPARAMETERS
    step_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step_ends.append(time.perf_counter())

    profiled = _collect_profiling()
    vllm: dict[str, Any] = {}
    if mode in ("colocate", "colocate-reload"):
        vllm = {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": 512}
    if mode == "colocate-reload":
        _sync_by_reload()
    elif mode == "server":
        vllm = {"use_vllm": True, "vllm_mode": "server", "vllm_server_port": port}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    data = Dataset.from_list([{"prompt": t["messages"], "answer": t["answer"]} for t in _rows("tasks.jsonl")])
    config = GRPOConfig(
        output_dir=str(out_dir),
        max_steps=steps,
        learning_rate=hp["learning_rate"],
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=seed,
        data_seed=seed,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        per_device_train_batch_size=hp["batch_size"] * hp["num_generations"],
        num_generations=hp["num_generations"],
        max_completion_length=hp["max_completion_length"],
        temperature=hp["temperature"],
        beta=0.0,
        remove_unused_columns=False,
        **vllm,
    )
    lora = LoraConfig(
        r=hp["lora_r"],
        lora_alpha=hp["lora_alpha"],
        lora_dropout=0.0,
        target_modules="all-linear",
        bias="none",
        task_type="CAUSAL_LM",
    )
    t0 = time.perf_counter()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[arithmetic_reward],
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[StepClock()],
    )
    setup_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t1
    adapter = out_dir / "adapter"
    trainer.save_model(str(adapter))
    logs = trainer.state.log_history
    step_s = [b - a for a, b in zip([t1, *step_ends], step_ends, strict=False)]
    exact, answers = heldout_exact(model_dir, adapter)
    return {
        "mode": mode,
        "steps": trainer.state.global_step,
        "setup_s": round(setup_s, 2),
        "train_s": round(train_s, 2),
        "step_s": [round(s, 3) for s in step_s],
        "step_s_median_after_first": round(statistics.median(step_s[1:]), 3) if len(step_s) > 1 else None,
        "rewards": [round(e["reward"], 4) for e in logs if "reward" in e],
        "profiled_s": {name: round(sum(times), 2) for name, times in profiled.items()},
        "heldout_exact": exact,
        "heldout_answers": answers,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("out", type=Path)
    parser.add_argument("--mode", choices=MODES, default="generate")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--port", type=int, default=8000, help="port of `trl vllm-serve` (--mode server)")
    args = parser.parse_args(argv)
    work = args.out.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    result = run(args.model_dir, work, args.mode, args.steps, args.seed, args.port)
    args.out.write_text(json.dumps(result, indent=1))
    json.dump({k: v for k, v in result.items() if k != "heldout_answers"}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
