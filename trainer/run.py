"""One training job: spec in, events out. ``main(spec, events, stop_requested)`` is the whole process.

supervised -> TRL ``SFTTrainer``; dpo -> ``DPOTrainer``; reinforcement -> ``GRPOTrainer`` with grader or
environment rewards. Rows of token ids (captured episodes) train as sampled: supervised rows through
``SFTTrainer``, preference pairs through ``trainer.token_dpo``, logged episodes with their sampler's logprobs
offline through ``trainer.offline_rl`` (no grader, no environment, nothing sampled). All of them train a
LoRA adapter (``build_lora_config``) on the base model. On a CPU: float32, ``use_cpu=True``, no gradient
checkpointing; on CUDA: bf16 and, for reinforcement, vLLM when asked. Checkpoints land in
``output_dir/checkpoints/checkpoint-N`` (adapter files plus optimiser, scheduler and RNG state, so they both
serve and resume); the final adapter in ``output_dir/adapter``.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.contract import (
    REQUEST,
    AnyHyperparameters,
    DataSummary,
    DpoHyperparameters,
    ReinforcementHyperparameters,
    SupervisedHyperparameters,
    TrainerSpec,
    model_defaults,
    resolve,
)
from trainer.distributed import is_main, world_size
from trainer.errors import TrainerError
from trainer.events import EventWriter

if TYPE_CHECKING:
    from trainer.environment import EnvironmentSession

logger = logging.getLogger(__name__)


def read_spec(path: str | Path) -> TrainerSpec:
    """Read and check ``SPEC.json``; ``invalid_spec`` names the first problem.

    Hyperparameters left out or ``"auto"`` are resolved as the gateway resolves them (``trainer.contract``),
    from the sizes of the data files and the base model's defaults.
    """
    from pydantic import ValidationError

    from trainer.data import read_jsonl

    try:
        raw = json.loads(Path(path).read_bytes())
    except (OSError, ValueError) as exc:
        raise TrainerError("invalid_spec", f"cannot read spec {path}: {exc}") from None
    try:
        if isinstance(raw, dict) and raw.get("method") in REQUEST:
            method = raw["method"]
            given = REQUEST[method].model_validate(raw.get("hyperparameters") or {})
            train = str(raw.get("training_file") or "")
            valid = raw.get("validation_file")
            data = DataSummary(
                rows=len(read_jsonl(train)) if train else 1,
                validation_rows=len(read_jsonl(valid, code="invalid_validation_file")) if valid else None,
            )
            try:
                resolved = resolve(method, given, data, model_defaults(str(raw.get("base_model") or "")))
            except ValueError as exc:
                raise TrainerError("invalid_spec", f"hyperparameters.{exc}") from None
            raw = {**raw, "hyperparameters": resolved.model_dump()}
        return TrainerSpec.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if not str(p).startswith(("constrained-", "literal[")))
        raise TrainerError("invalid_spec", f"{where}: {first['msg']}" if where else first["msg"]) from None


def build_lora_config(hp: AnyHyperparameters):  # -> peft.LoraConfig
    """The LoRA adapter every method trains: all attention and MLP projections of the base model."""
    from peft import LoraConfig

    return LoraConfig(
        r=hp.lora_r,
        lora_alpha=hp.lora_alpha,
        lora_dropout=0.0,
        target_modules="all-linear",
        bias="none",
        task_type="CAUSAL_LM",
    )


def _common_args(spec: TrainerSpec, on_cuda: bool) -> dict[str, Any]:
    """TrainingArguments shared by the three methods."""
    hp = spec.hyperparameters
    return {
        "output_dir": str(spec.checkpoints_dir),
        "num_train_epochs": hp.n_epochs,
        "max_steps": hp.max_steps if hp.max_steps is not None else -1,
        "learning_rate": hp.learning_rate,
        "lr_scheduler_type": "linear",
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": hp.checkpoint_every,
        "report_to": [],
        "seed": spec.seed,
        "data_seed": spec.seed,
        "use_cpu": not on_cuda,
        "bf16": on_cuda,
        "gradient_checkpointing": False,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "ddp_timeout": math.ceil(spec.collective_timeout_s),
    }


def _check_base_model(path: str) -> None:
    if not (Path(path) / "config.json").is_file():
        raise TrainerError("invalid_model", f"base_model {path} is not a model folder (no config.json)")


def _checkpoint_state(path: str | None) -> dict[str, Any]:
    """The trainer state saved with a checkpoint (empty without one); ``invalid_checkpoint`` for a folder this
    trainer did not write."""
    if path is None:
        return {}
    state_file = Path(path) / "trainer_state.json"
    try:
        state = json.loads(state_file.read_text())
        int(state["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        raise TrainerError("invalid_checkpoint", f"{path} is not a resumable checkpoint") from None
    return dict(state)


def _finish_from_final_checkpoint(spec: TrainerSpec, events: EventWriter, state: dict[str, Any]) -> int:
    """A resume from the run's last checkpoint (the run ended before its result was taken): nothing is left to
    train, so its adapter is the result. Training on would take steps past the run's end."""
    from trainer.callbacks import read_checkpoint_tokens

    assert spec.resume_from_checkpoint is not None
    step = int(state["global_step"])
    source = Path(spec.resume_from_checkpoint)
    adapter_dir = spec.adapter_dir
    adapter_dir.mkdir(parents=True, exist_ok=True)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        shutil.copy2(source / name, adapter_dir / name)
    logged = [entry for entry in state.get("log_history", []) if "loss" in entry or "train_loss" in entry]
    metrics = {"step": step}
    if logged:
        last = logged[-1]
        metrics["train_loss"] = last.get("loss", last.get("train_loss"))
    events.message(f"Training had finished at step {step}; saving its adapter", step=step)
    events.result(str(adapter_dir.resolve()), read_checkpoint_tokens(source), step, metrics)
    return 0


def _build_trainer(
    spec: TrainerSpec,
    model: Any,
    tokenizer: Any,
    train_ds: Any,
    on_cuda: bool,
    reward_funcs: list[Any],
    session: EnvironmentSession | None = None,
):
    hp = spec.hyperparameters
    args = _common_args(spec, on_cuda)
    peft_config = build_lora_config(hp)
    if isinstance(hp, SupervisedHyperparameters):
        from trl import SFTConfig, SFTTrainer

        sft_config = SFTConfig(
            **args,
            per_device_train_batch_size=hp.batch_size // world_size(),
            per_device_eval_batch_size=hp.batch_size // world_size(),
            max_length=hp.max_length,
            # Rows of token ids (a capture export's) carry their own labels: the ids the model sampled.
            assistant_only_loss="input_ids" not in train_ds.column_names,
        )
        return SFTTrainer(
            model=model,
            args=sft_config,
            train_dataset=train_ds,
            processing_class=tokenizer,
            peft_config=peft_config,
        )
    if isinstance(hp, DpoHyperparameters):
        from trl import DPOConfig, DPOTrainer

        dpo_config = DPOConfig(
            **args,
            per_device_train_batch_size=hp.batch_size // world_size(),
            per_device_eval_batch_size=hp.batch_size // world_size(),
            beta=hp.beta,
            max_length=hp.max_length,
        )
        if "prompt_ids" in train_ds.column_names:  # pairs of sampled token ids
            from trainer.token_dpo import build_trainer

            return build_trainer(
                dpo_config, model=model, tokenizer=tokenizer, train_ds=train_ds, peft_config=peft_config
            )
        return DPOTrainer(
            model=model,
            args=dpo_config,
            train_dataset=train_ds,
            processing_class=tokenizer,
            peft_config=peft_config,
        )
    assert isinstance(hp, ReinforcementHyperparameters)
    if "logprobs" in train_ds.column_names:  # logged episodes: offline, on the rewards already posted
        from trainer import offline_rl

        return offline_rl.build_trainer(
            args,
            model=model,
            tokenizer=tokenizer,
            train_ds=train_ds,
            peft_config=peft_config,
            batch_size=max(1, hp.batch_size // world_size()),
        )
    from trl import GRPOConfig, GRPOTrainer

    vllm: dict[str, Any] = {}
    if spec.use_vllm and on_cuda:
        vllm = {"use_vllm": True, "vllm_mode": "colocate"}
        if spec.vllm_server is not None:  # generation on devices of its own, weights synced each step
            host, _, port = spec.vllm_server.rpartition(":")
            vllm = {
                "use_vllm": True,
                "vllm_mode": "server",
                "vllm_server_host": host,
                "vllm_server_port": int(port),
            }
    grpo_config = GRPOConfig(
        **args,
        **vllm,
        # One step = batch_size prompts x num_generations completions, all in one optimiser step, split
        # evenly across the devices.
        per_device_train_batch_size=hp.batch_size * hp.num_generations // world_size(),
        num_generations=hp.num_generations,
        max_completion_length=hp.max_completion_length,
        temperature=hp.temperature,
        beta=hp.kl_beta,
        remove_unused_columns=False,
    )
    trainer_cls: Any = GRPOTrainer
    rollout: dict[str, Any] = {}
    if session is not None and session.multi_turn:
        from trainer.environment import environment_trainer_class

        trainer_cls = environment_trainer_class()
        rollout["rollout_func"] = session.rollout_func(hp.max_completion_length, hp.temperature)
    elif session is not None and session.pipeline is not None:  # on env servers: rewards during generation
        from trainer.pipeline import pipelined_trainer_class

        trainer_cls = pipelined_trainer_class(session.pipeline)
    from trainer.mismatch import measured_trainer_class

    return measured_trainer_class(trainer_cls)(
        model=model,
        reward_funcs=reward_funcs,
        args=grpo_config,
        train_dataset=train_ds,
        processing_class=tokenizer,
        peft_config=peft_config,
        **rollout,
    )


def main(spec: TrainerSpec, events: EventWriter, stop_requested: threading.Event | None = None) -> int:
    """Run one job and return the exit code (0: finished or stopped). Failures raise ``TrainerError``."""
    stop_requested = stop_requested or threading.Event()
    from trainer.data import load_dataset

    _check_base_model(spec.base_model)
    state = _checkpoint_state(spec.resume_from_checkpoint)
    resume_step = int(state.get("global_step", 0))
    if state and resume_step >= int(state.get("max_steps") or 0) > 0:
        return _finish_from_final_checkpoint(spec, events, state)
    train_ds = load_dataset(spec.method, spec.training_file)
    eval_ds = None
    if spec.evaluates:
        assert spec.validation_file is not None
        eval_ds = load_dataset(spec.method, spec.validation_file, code="invalid_validation_file")
    session: EnvironmentSession | None = None
    reward_funcs: list[Any] = []
    if spec.method == "reinforcement" and not spec.offline:
        from trainer.rewards import build_reward_funcs

        if spec.environment is not None:
            from trainer.environment import EnvironmentSession

            session = EnvironmentSession(spec)  # a package that does not start fails before the model loads
            if not session.multi_turn and hasattr(session.sandbox, "submit_reward_batch"):
                from trainer.pipeline import RewardPipeline

                session.pipeline = RewardPipeline(session)  # env servers: scored while generating
            events.message(
                f"Environment {session.name} ({session.kind}) started in its sandbox "
                f"({session.sandbox.backend})"
            )
        reward_funcs = build_reward_funcs(spec, session)  # a bad grader fails before the model loads
    try:
        return _train(spec, events, stop_requested, train_ds, eval_ds, resume_step, reward_funcs, session)
    finally:
        if session is not None:
            session.close()


def _check_token_ids(dataset: Any, vocab_size: int) -> None:
    """Rows of token ids (a capture export's) hold ids of this model's vocabulary, else the file is wrong."""
    for column in ("input_ids", "prompt_ids", "chosen_ids", "rejected_ids"):
        if column not in dataset.column_names:
            continue
        for n, ids in enumerate(dataset[column], start=1):
            if ids and max(ids) >= vocab_size:
                raise TrainerError(
                    "invalid_training_file",
                    f"example {n}: token id {max(ids)} is outside this model's vocabulary of {vocab_size} "
                    "(were the ids captured from another base model?)",
                )


def _train(
    spec: TrainerSpec,
    events: EventWriter,
    stop_requested: threading.Event,
    train_ds: Any,
    eval_ds: Any,
    resume_step: int,
    reward_funcs: list[Any],
    session: EnvironmentSession | None,
) -> int:
    events.message(f"Validated {len(train_ds)} training examples for {spec.method} job {spec.job_id}")
    if eval_ds is not None:
        events.message(f"Validated {len(eval_ds)} validation examples")
    events.message(
        "Hyperparameters: "
        + ", ".join(f"{k}={v}" for k, v in spec.hyperparameters.model_dump().items() if v != "auto"),
        data=spec.hyperparameters.model_dump(),
    )

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    from trainer.callbacks import EventCallback, read_checkpoint_tokens
    from trainer.evaluation import build_validator

    on_cuda = torch.cuda.is_available()
    if spec.use_vllm and not on_cuda:
        events.message("use_vllm ignored: no CUDA device; generating with transformers", level="warn")
    set_seed(spec.seed)
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec.base_model)
        model = AutoModelForCausalLM.from_pretrained(
            spec.base_model, dtype=torch.bfloat16 if on_cuda else torch.float32
        )
    except (OSError, ValueError) as exc:
        raise TrainerError("invalid_model", f"cannot load base_model {spec.base_model}: {exc}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    _check_token_ids(train_ds, model.config.vocab_size)
    if spec.method == "reinforcement":
        tokenizer.padding_side = "left"
    n_params = sum(p.numel() for p in model.parameters())
    events.message(f"Loaded model {Path(spec.base_model).name} ({n_params:,} parameters) on {model.device}")

    trainer = _build_trainer(spec, model, tokenizer, train_ds, on_cuda, reward_funcs, session)
    validator = None
    if eval_ds is not None:
        validator = build_validator(spec, trainer, eval_ds, reward_funcs, session)
    callback = EventCallback(
        events,
        stop_requested=stop_requested,
        tokens_offset=read_checkpoint_tokens(spec.resume_from_checkpoint)
        if spec.resume_from_checkpoint
        else 0,
        tokens_restored_by_state=spec.method == "reinforcement",
        validator=validator,
        eval_interval=spec.hyperparameters.eval_interval or 0,
    )
    trainer.add_callback(callback)
    if spec.resume_from_checkpoint:
        events.message(f"Resumed from step {resume_step}", step=resume_step)
    trainer.train(resume_from_checkpoint=spec.resume_from_checkpoint)
    step = trainer.state.global_step

    if callback.stopped_at is not None:
        events.message(f"stopped at step {step}", step=step)
        events.stopped(step, callback.last_checkpoint)
        return 0
    callback.announce_best()
    events.message("Saving adapter", step=step)
    adapter_dir = spec.adapter_dir
    # Sharded (FSDP) weights are gathered by every rank together; rank 0 writes the adapter.
    state_dict = (
        trainer.accelerator.get_state_dict(trainer.model_wrapped) if trainer.is_fsdp_enabled else None
    )
    if is_main():
        trainer.model.save_pretrained(str(adapter_dir), state_dict=state_dict)
    trainer.accelerator.wait_for_everyone()
    metrics = dict(callback.last_metrics)
    if "train_loss" in callback.summary:  # the mean over the whole run, beside the last step's loss
        metrics["train_loss_mean"] = callback.summary["train_loss"]
    events.result(str(adapter_dir.resolve()), callback.trained_tokens, step, metrics)
    return 0
