"""One real vLLM engine process, driven by a script of steps; the tests, demo and benchmark use it.

``python -m kvcore_vllm.session SPEC.json`` starts ``vllm.LLM`` on the spec's model, runs the
spec's steps in order and prints one JSON object per step on stdout (a line starting with
``KVCORE_SESSION``), so a parent process can run a *fresh* engine per phase and compare.

Spec keys: ``model`` (a directory), ``connector`` (``kv_connector_extra_config`` or null for
an engine without the connector), ``via`` (``"name"``: the registered name, or
``"module_path"``), ``executor`` (``"uni"``: scheduler and worker in the engine-core process,
or ``"mp"``), ``in_process`` (run the engine core inside this process), ``block_size``,
``tensor_parallel_size``, ``max_model_len``, ``kv_cache_bytes``, ``log_stats``, ``env`` (variables set before vLLM
starts), ``kv_transfer_config`` (instead of ``connector``: any other connector, raw),
``disable_hybrid_kv_cache_manager``, ``enable_lora`` (with ``max_lora_rank``, ``max_loras``),
``enable_prompt_embeds``, ``hf_overrides``, ``kv_events_endpoint`` (vLLM publishes its KV events
there over ZMQ, the connector's included), ``steps``.

Steps (``op``): ``generate`` (``prompts``: token-id lists, or ``{"after": STEP, "extra": [...]}``
for a next chat turn of an earlier step, ``max_tokens``, ``logprobs`` (also return each sampled
token's logprob); returns tokens,
``num_cached_tokens``, the wall time and, from vLLM's request stats, ``ttft_s`` and
``decode_step_s``), ``reset_prefix_cache`` (drops vLLM's own prefix cache,
so the next prompt can only hit the connector), ``log_stats`` (forces vLLM's stat log and
returns the ``KV Transfer metrics`` it printed since the previous ``log_stats``, summed), ``call`` (``target``: ``"module:function"``
called with ``args``, and ``engine=`` the ``LLM`` if it takes one, e.g. to damage a store between
two prompts), ``shutdown`` (closes the
engine and reports kvcore threads and store files still open), ``sleep``.

Models are written on the spot with random weights (:func:`write_model`): nothing is
downloaded.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import inspect
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "MARKER",
    "MODEL_SIZES",
    "EngineRun",
    "MetricsCapture",
    "failure_report",
    "parse_metrics",
    "run_in_subprocess",
    "run_session",
    "start_engine",
    "write_model",
]

#: Prefix of the lines a session prints for its parent.
MARKER = "KVCORE_SESSION "

#: Random models the tests and the benchmark write: Llama unless ``model_type`` says otherwise
#: (vLLM's CPU attention needs a head size from its list: 32, 64, 80, ...; its CPU MLA backend
#: a latent of 512 + 64).
MODEL_SIZES: dict[str, dict[str, Any]] = {
    # ~0.4 M parameters: an engine starts in ~20 s on 2 cores and prefill is near free
    "tiny": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
    },
    # ~0.1 B parameters: prefill of a few thousand tokens takes seconds, restoring it less
    "bench": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 4096,
        "max_position_embeddings": 8192,
    },
    # Gemma 3 (text): sliding-window layers (a 64-token window) between full-attention ones,
    # two KV cache groups under vLLM's hybrid manager
    "swa": {
        "model_type": "gemma3_text",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
    },
    # Qwen3-Next: gated delta net (Mamba-style state) layers between full-attention ones, two KV
    # cache groups; vLLM's CPU GDN kernel needs 128-wide linear heads, and with 4 x 128-wide
    # KV heads an attention page of 64 tokens holds the state (vLLM picks block size 64)
    "mamba": {
        "model_type": "qwen3_next",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention"] * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 1,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "mlp_only_layers": [],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
    },
    # DeepSeek-V3 with MLA (one latent per token), every layer dense: ~3 M parameters
    "mla": {
        "model_type": "deepseek_v3",
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
        "rope_scaling": None,
        "tie_word_embeddings": False,
    },
}


def write_model(path: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write a randomly initialised model of :data:`MODEL_SIZES` (bfloat16) to ``path`` unless
    it is already there."""
    path = Path(path)
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    import torch
    import transformers

    if size not in MODEL_SIZES:
        raise ValueError(f"size: {size!r} is not one of {sorted(MODEL_SIZES)}")
    torch.manual_seed(seed)
    fields = dict(MODEL_SIZES[size])
    model_type = fields.pop("model_type", "llama")
    config = transformers.AutoConfig.for_model(model_type, **fields, torch_dtype="bfloat16")
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    # Written under a name of this process's own, then renamed: a reader never sees half a
    # model, and two processes writing the same one at once (test workers) do not mix files.
    tmp = path.with_name(f"{path.name}.partial-{os.getpid()}")
    model.save_pretrained(tmp)
    try:
        tmp.rename(path)
    except OSError:
        if not (path / "model.safetensors").exists():
            raise
        shutil.rmtree(tmp)  # another process published the same model first
    return path


#: A ``load_policy`` for every connector of a spec that names none (the test suite sets
#: ``always``: its engines check what a restore delivers, whichever way the load-or-recompute
#: decision would go for a tiny model; the decision has tests and a benchmark of its own)
LOAD_POLICY_ENV = "KVCORE_VLLM_SESSION_LOAD_POLICY"


def start_engine(spec: dict[str, Any]) -> Any:
    """A ``vllm.LLM`` for ``spec`` (the keys of the module docstring; ``steps`` unused)."""
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "block_size": spec.get("block_size", 32),
        "max_model_len": spec.get("max_model_len", 2048),
        "kv_cache_memory_bytes": spec.get("kv_cache_bytes", 64 << 20),
        "distributed_executor_backend": spec.get("executor", "uni"),
        "disable_log_stats": not spec.get("log_stats", True),
        "seed": 0,
    }
    if spec.get("tensor_parallel_size", 1) > 1:
        kwargs["tensor_parallel_size"] = spec["tensor_parallel_size"]
    if spec.get("disable_hybrid_kv_cache_manager"):
        # what vLLM does by itself for a connector without HMA support: a connector-less
        # engine set this way differs from the connector's engine by the connector only
        kwargs["disable_hybrid_kv_cache_manager"] = True
    if spec.get("enable_lora"):
        kwargs["enable_lora"] = True
        kwargs["max_lora_rank"] = spec.get("max_lora_rank", 8)
        kwargs["max_loras"] = spec.get("max_loras", 2)
    if spec.get("enable_prompt_embeds"):
        kwargs["enable_prompt_embeds"] = True
    if spec.get("hf_overrides"):
        kwargs["hf_overrides"] = spec["hf_overrides"]
    if spec.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    if spec.get("attention_backend"):  # e.g. the reference CPU_MLA where AMX_MLA would win
        kwargs["attention_backend"] = spec["attention_backend"]
    if spec.get("kv_events_endpoint"):
        from vllm.config import KVEventsConfig

        # vLLM's own publisher, on the endpoint the caller listens to (127.0.0.1 or ipc://)
        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=spec["kv_events_endpoint"],
            topic="kv-events",
        )
    connector = spec.get("connector")
    if spec.get("kv_transfer_config") is not None:  # another connector, for comparisons
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    elif connector is not None:
        policy = os.environ.get(LOAD_POLICY_ENV)
        if policy and "load_policy" not in connector:
            connector = {**connector, "load_policy": policy}
        transfer: dict[str, Any] = {
            "kv_connector": "KVCoreConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": connector,
        }
        if spec.get("via") == "module_path":
            transfer["kv_connector_module_path"] = "kvcore_vllm"
        kwargs["kv_transfer_config"] = transfer
    return LLM(**kwargs)


class MetricsCapture(logging.Handler):
    """Keeps the ``KV Transfer metrics: k=v, ...`` lines vLLM's stat logger prints."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            text = record.getMessage()
            if "KV Transfer metrics" in text:
                self.lines.append(text)


def parse_metrics(lines: list[str]) -> dict[str, float]:
    """Sum the ``name=value`` pairs of vLLM's ``KV Transfer metrics`` lines."""
    totals: dict[str, float] = {}
    for line in lines:
        body = line.split("KV Transfer metrics:", 1)[-1]
        # names: counters, and per-tenant figures whose tenant may hold '-' (team-a)
        for name, value in re.findall(r"([\w.-]+)=([-\d.e+]+)", body):
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def _prompt(item: Any, history: dict[str, tuple[list[int], list[int]]]) -> list[int]:
    """A token list; ``{"after": NAME, "extra": [...]}``: a follow-up turn of step NAME's
    first prompt (its prompt, its output, then ``extra``); or ``{"tokens": [...]}`` with a
    request's ``cache_salt``, ``lora`` and ``embeds`` (see :func:`_request_fields`)."""
    if isinstance(item, dict):
        if "tokens" in item:
            return [int(t) for t in item["tokens"]]
        prompt, output = history[item["after"]]
        return [*prompt, *output, *item.get("extra", [])]
    return [int(t) for t in item]


def _request_fields(item: Any, loras: dict[str, int]) -> tuple[dict[str, Any], Any]:
    """A prompt's ``cache_salt`` (in the prompt dict, as vLLM takes it), prompt embeddings
    (``{"seed", "hidden", "scale"}``: random rows, one per token, given instead of the token
    ids) and LoRA adapter (``{"name", "path"}``: a ``LoRARequest``; ids are given in order of
    first use)."""
    if not isinstance(item, dict):
        return {}, None
    fields: dict[str, Any] = {"cache_salt": item["cache_salt"]} if item.get("cache_salt") else {}
    embeds = item.get("embeds")
    if embeds:
        # prompt embeddings instead of token ids: one row per token, random from a seed
        import torch

        generator = torch.Generator().manual_seed(int(embeds["seed"]))
        rows = torch.randn(len(item["tokens"]), int(embeds["hidden"]), generator=generator)
        fields["prompt_embeds"] = (rows * float(embeds.get("scale", 1.0))).to(torch.bfloat16)
    lora = item.get("lora")
    if not lora:
        return fields, None
    from vllm.lora.request import LoRARequest

    lora_id = loras.setdefault(lora["name"], len(loras) + 1)
    return fields, LoRARequest(lora["name"], lora_id, lora["path"])


#: LoRA ids this process gave adapters, by name
_LORAS: dict[str, int] = {}


def _generate(
    llm: Any, step: dict[str, Any], history: dict[str, tuple[list[int], list[int]]]
) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0,
        max_tokens=step.get("max_tokens", 8),
        ignore_eos=True,  # random models emit EOS at random: keep every output's length
        detokenize=False,
        # each sampled token's logprob: a restore that computes the same KV gives the same
        # float, while a near-miss (a wrong recurrent state) may still pick the same tokens
        logprobs=0 if step.get("logprobs") else None,
    )
    token_lists = [_prompt(p, history) for p in step["prompts"]]
    fields = [_request_fields(p, _LORAS) for p in step["prompts"]]
    prompts = [
        f if "prompt_embeds" in f else {"prompt_token_ids": p, **f}
        for p, (f, _) in zip(token_lists, fields, strict=True)
    ]
    lora_requests = [lora for _, lora in fields]
    kwargs: dict[str, Any] = {}
    if any(lora is not None for lora in lora_requests):
        kwargs["lora_request"] = lora_requests
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, **kwargs)
    seconds = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    history[step.get("name", "generate")] = (token_lists[0], tokens[0])
    timing: dict[str, list[float]] = {"ttft_s": [], "decode_step_s": []}
    for o in outputs:
        stats = getattr(o, "metrics", None)  # vLLM's per-request stats (log_stats on)
        if stats is None or not getattr(stats, "first_token_ts", 0):
            continue
        timing["ttft_s"].append(float(stats.first_token_latency))
        steps = int(stats.num_generation_tokens) - 1
        if steps > 0:
            timing["decode_step_s"].append((stats.last_token_ts - stats.first_token_ts) / steps)
    return {
        **{k: v for k, v in timing.items() if v},
        "prompt_lengths": [len(p) for p in token_lists],
        "tokens": tokens,
        "num_cached_tokens": [int(o.num_cached_tokens or 0) for o in outputs],
        "seconds": seconds,
        **(
            {"logprobs": [_sampled_logprobs(o.outputs[0]) for o in outputs]}
            if step.get("logprobs")
            else {}
        ),
    }


def _sampled_logprobs(completion: Any) -> list[float]:
    """The logprob of each token ``completion`` sampled."""
    return [
        float(step[token].logprob)
        for token, step in zip(completion.token_ids, completion.logprobs or (), strict=True)
    ]


def _reset_prefix_cache(llm: Any, in_process: bool, timeout_s: float = 30.0) -> bool:
    """Drop vLLM's prefix cache. vLLM refuses while finished requests still hold blocks (the
    connector keeps them until their saves are stored): step the engine until it accepts."""
    deadline = time.monotonic() + timeout_s
    while True:
        if llm.reset_prefix_cache():
            return True
        if time.monotonic() > deadline:
            return False
        if in_process:
            llm.llm_engine.step()  # an empty step collects the workers' finished saves
        time.sleep(0.02)


def _leftovers(store_root: str | None) -> dict[str, Any]:
    threads = sorted(
        t.name for t in threading.enumerate() if t.is_alive() and t.name.startswith("kvcore")
    )
    files: list[str] = []
    if store_root:
        root = os.path.realpath(store_root)
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith(root):
                    files.append(target)
    return {"kvcore_threads": threads, "store_files_open": sorted(files)}


def run_session(spec: dict[str, Any], emit: Any = None) -> list[dict[str, Any]]:
    """Run ``spec`` (see the module docstring); return (and ``emit``) one result per step."""
    os.environ.update({str(k): str(v) for k, v in spec.get("env", {}).items()})
    if spec.get("in_process"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    results: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    llm = start_engine(spec)
    # after the engine: vLLM configures its loggers while it starts
    capture = MetricsCapture()
    logging.getLogger("vllm").addHandler(capture)
    started = {"op": "start", "seconds": time.perf_counter() - t0}
    results.append(started)
    if emit:
        emit(started)
    history: dict[str, tuple[list[int], list[int]]] = {}
    for step in spec.get("steps", []):
        op = step["op"]
        out: dict[str, Any] = {"op": op, "name": step.get("name", op)}
        if op == "generate":
            out.update(_generate(llm, step, history))
        elif op == "reset_prefix_cache":
            out["ok"] = _reset_prefix_cache(llm, spec.get("in_process", False))
        elif op == "log_stats":
            # vLLM also logs on its own every few seconds: sum every line since the last step
            llm.llm_engine.do_log_stats()
            out["metrics"] = parse_metrics(capture.lines)
            capture.lines.clear()
        elif op == "call":
            module, _, func = step["target"].partition(":")
            target = getattr(importlib.import_module(module), func)
            kwargs = dict(step.get("args", {}))
            if "engine" in inspect.signature(target).parameters:
                kwargs["engine"] = llm  # e.g. to name the objects this engine stored
            out["result"] = target(**kwargs)
        elif op == "sleep":
            time.sleep(float(step["seconds"]))
        elif op == "shutdown":
            llm.llm_engine.engine_core.shutdown()
            del llm
            llm = None
            gc.collect()
            time.sleep(0.5)  # threads finishing their last task
            out.update(_leftovers(step.get("store_root")))
        else:
            raise ValueError(f"steps[].op: unknown op {op!r}")
        results.append(out)
        if emit:
            emit(out)
    if llm is not None:
        llm.llm_engine.engine_core.shutdown()
    return results


@dataclass
class EngineRun:
    """What one engine process printed: one result per step, and its log."""

    results: list[dict[str, Any]]
    log: str

    def step(self, name: str) -> dict[str, Any]:
        for r in self.results:
            if r.get("name") == name:
                return r
        raise KeyError(f"no step named {name!r} in {[r.get('name') for r in self.results]}")


def run_in_subprocess(
    spec: dict[str, Any], workdir: Path, label: str, timeout_s: float = 600.0
) -> EngineRun:
    """Run ``spec`` in a fresh Python process; its log is kept in ``workdir/<label>.log``.

    Raises RuntimeError with the log's tail when the engine process fails.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / f"{label}.json"
    spec_path.write_text(json.dumps(spec))
    log_path = workdir / f"{label}.log"
    # results go to a file of their own: on stdout, a line of vLLM's engine process (which
    # shares the pipe) once landed inside a result line
    results_path = workdir / f"{label}.results.jsonl"
    results_path.unlink(missing_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "kvcore_vllm.session", str(spec_path), str(results_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            cwd=str(workdir),
        )
    lines = results_path.read_text().splitlines() if results_path.exists() else []
    results = [json.loads(line) for line in lines if line]
    text = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(
            f"engine {label!r} exited with {proc.returncode} (log: {log_path})\n"
            + failure_report(text)
        )
    return EngineRun(results, text)


#: a failure report keeps this many tracebacks (the first ones: the root cause comes first, what
#: it set off follows) and log lines at its end
_REPORT_TRACEBACKS = 3
_REPORT_TAIL_LINES = 30


def failure_report(log: str) -> str:
    """What an engine's log says of why it failed: its first tracebacks (vLLM's engine core
    logs the root cause in its own process, long before the front end's "Engine core
    initialization failed. See root cause above"), its error lines, then its last lines."""
    lines = log.splitlines()
    tracebacks: list[list[str]] = []
    current: list[str] | None = None
    for line in lines:
        if "Traceback (most recent call last):" in line:
            current = [line]
            tracebacks.append(current)
        elif current is not None:
            current.append(line)
            # a traceback ends at its exception's line: the first one not indented (a
            # process's log prefix, e.g. "(EngineCore pid=7) ", is ignored)
            body = line.split(") ", 1)[-1] if line.startswith("(") else line
            if body and not body.startswith((" ", "\t")):
                current = None
    errors = [line for line in lines if " ERROR " in line or line.startswith("ERROR")]
    parts = []
    for i, tb in enumerate(tracebacks[:_REPORT_TRACEBACKS]):
        parts.append(f"-- traceback {i + 1} of {len(tracebacks)}:\n" + "\n".join(tb[-60:]))
    if errors:
        parts.append("-- error lines:\n" + "\n".join(errors[:20]))
    parts.append("-- log tail:\n" + "\n".join(lines[-_REPORT_TAIL_LINES:]))
    return "\n".join(parts)


def _print(result: dict[str, Any]) -> None:
    print(MARKER + json.dumps(result), flush=True)


def _appender(path: str) -> Callable[[dict[str, Any]], None]:
    """Each result as one line of ``path``, written whole before the next step runs."""

    def emit(result: dict[str, Any]) -> None:
        with open(path, "a") as out:
            out.write(json.dumps(result) + "\n")

    return emit


def main(argv: list[str] | None = None) -> int:
    """``python -m kvcore_vllm.session SPEC.json [RESULTS.jsonl]``: the results as lines of
    RESULTS.jsonl, or (without it) as lines of stdout after :data:`MARKER`."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print("usage: python -m kvcore_vllm.session SPEC.json [RESULTS.jsonl]", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    for path in spec.get("sys_path", []):
        sys.path.insert(0, path)
    run_session(spec, emit=_appender(args[1]) if len(args) == 2 else _print)
    return 0


if __name__ == "__main__":
    sys.exit(main())
