r"""An lm-evaluation-harness (``lm_eval``, tested with 0.4.13) model named ``mars_jax``.

Importing this module registers the model. lm_eval 0.4.13 has no plugin mechanism (it finds
models only in its own registry), so its CLI reaches the model through this module's wrapper,
which registers it and then runs ``lm_eval``'s own CLI with the same arguments:

  python -m mars_jax.lm_eval_adapter --model mars_jax \
      --model_args workdir=runs/tiny/mars,threshold=0.95 --batch_size 8 --tasks gsm8k

From Python: ``import mars_jax.lm_eval_adapter`` then ``lm_eval.simple_evaluate(model="mars_jax",
model_args="workdir=...,threshold=0.95", ...)``.

Model arguments: ``workdir`` (a run or a Hugging Face directory, required), ``threshold``
(default 1.0: AR decoding), ``block_size`` (default: the run's), ``cache_mode``, ``rule``
(`mars_jax.decode`), ``step`` (default: the latest checkpoint), ``seed`` (sampling: request i
of a call gets seed + i), ``max_gen_toks`` (default 256), ``max_length`` (default: the model's
context as lm_eval's transformers backend reads it from the model config, `hflm_max_length`; a
scored context keeps its last max_length + 1 tokens with the continuation, a generation context
its last max_length - max_gen_toks, and ``loglikelihood_rolling`` scores in windows of it),
``add_bos_token`` and ``prefix_token_id`` (as that backend's); lm_eval's ``--batch_size`` (an
integer) sets the rows per decoding or scoring batch; lm_eval's ``max_batch_size`` and
``device`` are accepted and ignored (devices are jax's).

Scores equal lm_eval 0.4.13's transformers backend (``HFLM``, with transformers 5) on the same
model and requests, so that numbers are comparable with it: text is encoded with the special
tokens the model's tokenizer adds (`vocab.special_tokens`: Llama 3's BOS, none for Qwen2.5) by HFLM's
rule (`tok_encode`; ``add_bos_token=False`` adds none), an empty context is HFLM's prefix token
(bos_token, else eos_token), and context / continuation pairs are split by lm_eval's
``_encode_pair``. A continuation left with no token of its own there (its first token spans the
join, ``"hello wor"`` + ``"ld"``) is refused naming the request, where HFLM stops on an
assertion (scoring it, as this adapter once did, gave 0.0 and greedy: a choice that always won).
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

try:
    import lm_eval.models  # noqa: F401  lm_eval's own models: it adds them only to an empty registry
except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] != "lm_eval":
        raise
    raise ModuleNotFoundError(
        "mars_jax.lm_eval_adapter needs lm-evaluation-harness, an optional dependency: "
        "pip install -e '.[lm-eval]' (lm_eval==0.4.13)",
        name="lm_eval",
    ) from None
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    DEFAULT_MAX_LENGTH,
    TOKENIZER_INFINITY,
    chunks,
    normalize_gen_kwargs,
    resolve_max_length,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string

from mars_jax import config, decode, sources, storage
from mars_jax.decode_options import DecodeOptions
from mars_jax.detokenizer import Detokenizer
from mars_jax.errors import InputError
from mars_jax.model import causal_mask

# Under lm_eval's logger, which its CLI shows at INFO (it leaves other loggers alone).
log = logging.getLogger("lm_eval.models.mars_jax")

# generate_until's generation kwargs after `normalize_gen_kwargs`; any other key is refused.
_GEN_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature"}


def _round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (at least one): fewer shapes to compile."""
    return max(-(-n // multiple) * multiple, multiple)


def _namespace(value):
    """A config.json dict as the attributes transformers' config object has (nested dicts too)."""
    if isinstance(value, dict):
        return SimpleNamespace(**{k: _namespace(v) for k, v in value.items()})
    return value


def _read_json(path: str) -> dict:
    """The JSON object in file ``path`` ({} where there is none)."""
    return json.loads(storage.read_text(path)) if storage.exists(path) else {}


def hflm_max_length(path: str, model, tokenizer_config: dict) -> int:
    """The ``max_length`` lm_eval's transformers backend (HFLM) takes by default for the model at
    ``path`` (`lm_eval.models.utils.resolve_max_length`: ``text_config``, then ``n_positions``,
    ``max_position_embeddings``, ``n_ctx`` of the model config, then the tokenizer's
    ``model_max_length``, then 2048). The model config is what transformers reads: a Hugging
    Face directory's config.json (``max_position_embeddings`` absent: the family default, as the
    config class has it, which ``model.cfg`` holds), or a run's export (its
    ``max_position_embeddings``)."""
    hf = _read_json(storage.join(path, "config.json")) if sources.is_hf_dir(path) else {}
    hf.setdefault("max_position_embeddings", model.cfg.max_position_embeddings)
    limit = tokenizer_config.get("model_max_length", TOKENIZER_INFINITY)
    return resolve_max_length(
        _namespace(hf), SimpleNamespace(model_max_length=limit), default=DEFAULT_MAX_LENGTH
    )


def _flag(name: str, value) -> bool | None:
    """A boolean model argument (lm_eval passes True/False, or a string from a dict)."""
    if value is None or isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "false"):
        return str(value).lower() == "true"
    raise InputError(f"mars_jax: {name} must be True or False, got {value!r}")


@jax.jit
def _continuation_scores(model, ids, starts, targets):
    """Plain causal (AR) forward over ids int32 [R, T] (right-padded); targets int32 [R, C] are
    predicted at positions starts[r] .. starts[r] + C - 1 (int32 [R]). Returns (log-probs float32
    [R, C] of the targets, greedy bool [R, C]: each target is the argmax there)."""
    t = ids.shape[1]
    hidden, _ = model(ids, jnp.broadcast_to(jnp.arange(t), ids.shape), causal_mask(t))
    at = jnp.minimum(starts[:, None] + jnp.arange(targets.shape[1]), t - 1)
    logits = model.logits(jnp.take_along_axis(hidden, at[..., None], axis=1))
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return picked, jnp.argmax(logp, axis=-1) == targets


@register_model("mars_jax")
class MarsLM(TemplateLM):
    """A mars-jax run as an lm_eval model (module docstring for the arguments).

    ``generate_until`` decodes each context (raw text; lm_eval renders the chat template first
    with ``--apply_chat_template``, through `apply_chat_template`) with `decode.generate_batched`
    at the run's threshold, its text cut where an ``until`` string first completes (a
    `Detokenizer`: as transformers' stop criterion then lm_eval's split give); ``max_gen_toks``
    bounds the completion in tokens. ``loglikelihood`` sums the log-probabilities of the
    continuation's tokens under the plain causal forward (the clean AR path, no masks) and says
    whether greedy decoding would give them; lm_eval's `TemplateLM` splits the text into
    context and continuation tokens (`loglikelihood`). Accepted tokens per decoding forward,
    over all ``generate_until`` calls so far, are logged, kept in ``tokens_per_forward`` and
    written into lm_eval's results (`get_model_info`).

    `from_args` raises FileNotFoundError for a workdir without a checkpoint and InputError for
    a bad model argument; ``generate_until`` InputError for an unsupported generation kwarg,
    ``loglikelihood`` for a continuation without a token of its own.
    """

    def __init__(
        self,
        opened: sources.Opened,
        options: DecodeOptions,
        *,
        seed: int = 0,
        max_gen_toks: int = 256,
        max_length: int | None = None,
        batch_size: int = 1,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
    ):
        """lm_eval's model of the model ``opened`` (`sources.open`) decoding as ``options``;
        lm_eval itself builds one from its model arguments (`from_args`)."""
        super().__init__()
        self.model, self.tokenizer, self.step = opened.model, opened.tokenizer, opened.step
        self.workdir, self.options, self.batch_size = opened.path, options, batch_size
        self.ids = opened.decode_ids()  # a trimmed run's ids
        self.decode_kwargs = dict(  # what get_model_info reports
            **options.summary(), mask_id=opened.mask_id, eos_ids=opened.stop_ids
        )
        # As HFLM: its tokenizer's special tokens, BOS and prefix token, default max_length.
        tokenizer_config = opened.tokenizer_config()
        self.add_bos_token = add_bos_token
        self._before, self._after = opened.special_tokens(add_bos_token)
        bos = getattr(self.tokenizer, "qwen", self.tokenizer).roles["bos_token"]
        self._bos_text = bos  # None: the files name no bos_token
        if prefix_token_id is None:
            prefix_token_id = self.tokenizer.eos_id if bos is None else self.tokenizer.bos_id
        self._prefix_id = int(prefix_token_id)
        self._prefix_text = self.tokenizer.decode([self._prefix_id], skip_special_tokens=False)
        self.max_length = max_length or hflm_max_length(opened.path, self.model, tokenizer_config)
        self.seed, self.max_gen_toks = seed, max_gen_toks
        self._rendered: dict[str, list[int]] = {}  # apply_chat_template's text -> its ids
        self.accepted = self.forwards = 0
        log.info("mars_jax: %s step %d, %s", self.workdir, self.step, self.decode_kwargs)

    @classmethod
    def from_args(
        cls,
        workdir: str,
        threshold: float = 1.0,
        block_size: int | None = None,
        cache_mode: str = "sliding",
        rule: str = "prob",
        step: int | None = None,
        seed: int = 0,
        max_gen_toks: int = 256,
        max_length: int | None = None,
        batch_size: int | str | None = None,
        add_bos_token: bool | str | None = None,
        prefix_token_id: int | None = None,
        max_batch_size=None,
        device=None,
    ) -> MarsLM:
        """The model of lm_eval's model arguments (module docstring), its decoding settings
        checked before the model is loaded: `decode.generate` would refuse them only at the
        first generate_until request, after lm_eval's task setup and any loglikelihood tasks."""
        options = config.check_decoding(
            threshold=threshold,
            block_size=block_size,
            cache_mode=cache_mode,
            rule=rule,
            prefix="mars_jax: ",
        )
        try:
            rows = int(batch_size or 1)
        except ValueError:
            raise InputError(f"mars_jax: batch_size must be an integer, got {batch_size!r}")
        if rows < 1:
            raise InputError(f"mars_jax: batch_size must be >= 1, got {batch_size!r}")
        add_bos_token = _flag("add_bos_token", add_bos_token)
        opened = sources.open(workdir, block_size=block_size, step=step)
        return cls(
            opened,
            options.replace(block_size=opened.block_size),
            seed=seed,
            max_gen_toks=max_gen_toks,
            max_length=max_length,
            batch_size=rows,
            add_bos_token=add_bos_token,
            prefix_token_id=prefix_token_id,
        )

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> MarsLM:
        """lm_eval's constructor from a dict of model arguments (`from_args`)."""
        more = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls.from_args(**arg_dict, **more)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """lm_eval's constructor from ``key=value,...`` model arguments (`from_args`)."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def eot_token_id(self) -> int:
        """<|im_end|>, the end of a chat turn."""
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """The context of a request whose context is empty and of the first rolling window:
        as HFLM, the ``prefix_token_id`` model argument, else the tokenizer's bos_token, else
        its eos_token."""
        return self._prefix_id

    @property
    def tokenizer_name(self) -> str:
        """The run directory: names the chat template in lm_eval's request cache keys."""
        return self.workdir

    @property
    def tokens_per_forward(self) -> float:
        """Accepted tokens per decoding forward over all `generate_until` calls (0.0 before)."""
        return self.accepted / max(self.forwards, 1)

    def get_model_info(self) -> dict:
        """What lm_eval adds to its results' ``config``: the run, the decoding settings and the
        tokens per forward of all ``generate_until`` calls (accepted tokens, EOS included, per
        decoding forward; prefill not counted; 0.0 without generation requests)."""
        return {
            "workdir": self.workdir,
            "step": self.step,
            **self.decode_kwargs,
            "tokens_per_forward": self.tokens_per_forward,
            "decoded_tokens": self.accepted,
            "decoding_forwards": self.forwards,
        }

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt=True) -> str:
        """``chat_history`` rendered by the run's chat template (a str). Its ids, with message
        text that spells a control token kept as text (`Tokenizer.apply_chat_template`), are
        kept for `tok_encode`: lm_eval hands the rendered string back as a context. Without
        ``add_generation_prompt`` (a task's ``gen_prefix``: the history ends with the assistant's
        opening words) the last message is continued, its turn left open, as HFLM renders it."""
        keep_open = not add_generation_prompt
        text = self.tokenizer.render_chat(
            chat_history, add_generation_prompt, continue_final_message=keep_open
        )
        self._rendered[text] = self.tokenizer.apply_chat_template(
            chat_history, add_generation_prompt, continue_final_message=keep_open
        )
        return text

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        """The token ids of ``string`` as HFLM's ``tok_encode`` gives them: with the special
        tokens the tokenizer adds (`vocab.special_tokens`: Llama 3's BOS) unless
        ``add_special_tokens`` is False, or it is None and either ``string`` starts with the
        prefix token's text or the model argument ``add_bos_token`` is False. Written control
        tokens become ids, except in a prefix rendered by `apply_chat_template`, whose ids are
        that chat's."""
        if add_special_tokens is None:
            add_special_tokens = (
                not string.startswith(self._prefix_text) and self.add_bos_token is not False
            )
        return self._encode(string, add_special_tokens)

    def _encode(self, string: str, add_special_tokens: bool) -> list[int]:
        """``string``'s ids (a rendered chat prefix: its chat's), between the tokenizer's
        special tokens where ``add_special_tokens``."""
        prefix = max((t for t in self._rendered if string.startswith(t)), key=len, default="")
        rest = string[len(prefix) :]
        ids = self._rendered.get(prefix, []) + (self.tokenizer.encode(rest) if rest else [])
        return self._before + ids + self._after if add_special_tokens else ids

    def _encode_request(self, i: int, context: str) -> list[int]:
        """The ids of generation request ``i``'s context as HFLM's ``tok_batch_encode`` gives
        them (special tokens unless the context starts with the bos_token's text or
        ``add_bos_token`` is False; the prefix token for an empty one). Raises ValueError
        naming the request, e.g. for a token outside a trimmed run's vocabulary."""
        specials = self.add_bos_token is not False and not (
            self._bos_text is not None and context.startswith(self._bos_text)
        )
        try:
            return self._encode(context, specials) or [self.prefix_token_id]
        except ValueError as e:
            raise InputError(f"mars_jax: request {i}: {e}") from None

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """[(log-prob float, greedy bool)] per (context, continuation) request, encoded as
        lm_eval's `TemplateLM` (HFLM's) encodes them: an empty context is the prefix token
        (or the continuation's first token where that is it), else `_encode_pair` (the
        context's trailing whitespace moves to the continuation; the continuation's ids are
        those of context + continuation past the context's). Raises ValueError naming the
        request for a continuation left without a token of its own (its first token spans the
        join with the context: HFLM stops on an assertion there), or longer than max_length."""
        encoded = []
        for i, request in enumerate(requests):
            context, continuation = request.args
            where = f"mars_jax: request {i}" + (
                f" (task {request.task_name}, doc {request.doc_id})" if request.task_name else ""
            )
            try:
                if context:
                    ctx, cont = self._encode_pair(context, continuation)
                else:
                    cont = self.tok_encode(continuation, add_special_tokens=False)
                    split = bool(cont) and cont[0] == self.prefix_token_id
                    ctx, cont = (cont[:1], cont[1:]) if split else ([self.prefix_token_id], cont)
            except ValueError as e:
                raise InputError(f"{where}: {e}") from None
            if not cont:
                shown = repr(context) if len(context) <= 80 else f"ending {context[-80:]!r}"
                raise InputError(
                    f"{where}: continuation {continuation!r} has no token of its own after "
                    f"context {shown}: its first token spans the join with the context "
                    "(lm_eval's transformers backend stops on an assertion here)"
                )
            if len(cont) > self.max_length:
                raise InputError(
                    f"{where}: continuation of {len(cont)} tokens, more than max_length "
                    f"{self.max_length}"
                )
            encoded.append(((context, continuation), ctx, cont))
        return self._loglikelihood_tokens(encoded, disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False):
        """[(log-prob float, greedy bool)] per ((context, continuation), context ids,
        continuation ids) request (context ids non-empty)."""
        results = []
        for batch in chunks(requests, self.batch_size):
            # As transformers' backend: the last max_length + 1 tokens, context cut on the left.
            seqs = [(ctx + cont)[-(self.max_length + 1) :][:-1] for _, ctx, cont in batch]
            ids = np.full(
                (self.batch_size, _round_up(max(map(len, seqs)), 64)),
                self.tokenizer.pad_id,
                np.int32,
            )
            targets = np.zeros(
                (self.batch_size, _round_up(max(len(c) for *_, c in batch), 8)), np.int32
            )
            starts = np.zeros((self.batch_size,), np.int32)
            for r, ((_, _, cont), seq) in enumerate(zip(batch, seqs)):
                ids[r, : len(seq)], targets[r, : len(cont)] = seq, cont
                starts[r] = max(len(seq) - len(cont), 0)
            logp, greedy = jax.device_get(_continuation_scores(self.model, ids, starts, targets))
            for r, (pair, _, cont) in enumerate(batch):
                n = len(cont)
                result = (float(logp[r, :n].sum(dtype=np.float64)), bool(greedy[r, :n].all()))
                self.cache_hook.add_partial("loglikelihood", pair, result)
                results.append(result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-probability of each request's text (`tok_encode`: with the tokenizer's BOS,
        as HFLM) after the prefix token, scored in windows of at most ``max_length`` tokens
        (lm_eval's rolling windows)."""
        results = []
        for (text,) in (r.args for r in requests):
            windows = [
                ((text, ""), ctx, cont)
                for ctx, cont in map(
                    make_disjoint_window,
                    get_rolling_token_windows(
                        self.tok_encode(text), self.prefix_token_id, self.max_length, 1
                    ),
                )
            ]
            results.append(sum(logp for logp, _ in self._loglikelihood_tokens(windows)))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), results[-1])
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """One completion (str) per (context, generation kwargs) request, decoded greedily
        (or sampled where the kwargs ask for a temperature > 0) and cut at ``until``."""
        settings = [normalize_gen_kwargs(r.args[1], self.max_gen_toks) for r in requests]
        groups: dict[tuple[float, int], list[int]] = {}
        for i, s in enumerate(settings):
            if unknown := sorted(set(s) - _GEN_KWARGS):
                raise InputError(f"mars_jax: request {i}: unsupported generation kwargs {unknown}")
            temperature = float(s.get("temperature", 0.0)) if s["do_sample"] else 0.0
            # One decode per budget: each request decodes (and is counted) up to its own.
            groups.setdefault((temperature, int(s["max_gen_toks"])), []).append(i)
        texts = [""] * len(requests)
        for (temperature, budget), rows in groups.items():
            # As transformers' backend: the context's last max_length - max_gen_toks tokens.
            keep = max(self.max_length - budget, 1)
            prompts = [self._encode_request(i, requests[i].args[0])[-keep:] for i in rows]
            out = decode.generate_batched(
                self.model,
                prompts,
                self.options.replace(temperature=temperature, max_new_tokens=budget),
                batch_size=self.batch_size,
                seed=[self.seed + i for i in rows],  # request i's seed, whatever its group
                **self.ids,
            )
            self.accepted += int(out.accepted.sum())
            self.forwards += int(out.row_forwards.sum())
            for i, tokens in zip(rows, out.completions()):
                text = Detokenizer(self.tokenizer, [u for u in settings[i]["until"] if u])
                texts[i] = text.add(tokens) + text.finish()
                self.cache_hook.add_partial("generate_until", requests[i].args, texts[i])
        log.info(
            "mars_jax: %.3f tokens per forward so far (threshold %.2f)",
            self.tokens_per_forward,
            self.options.threshold,
        )
        return texts


def main() -> None:
    """``python -m mars_jax.lm_eval_adapter ARGS``: lm_eval's CLI (``lm_eval ARGS``) with the
    ``mars_jax`` model registered. The errors that mars-jax's own programs print as one line
    (`cli.is_user_error`: a missing run, a bad model argument, a token outside a trimmed run's
    vocabulary) print ``error: ...`` and exit 1 here too; any other keeps its traceback."""
    from lm_eval.__main__ import cli_evaluate

    from mars_jax import cli, platforms

    platforms.cpu_unless_accelerator()  # no libtpu errors on a machine without a TPU
    try:
        cli_evaluate()
    except Exception as e:  # re-raised unless it is the user's
        if not cli.is_user_error(e):
            raise
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
