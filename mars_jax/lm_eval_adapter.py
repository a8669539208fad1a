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
of a call gets seed + i), ``max_gen_toks`` (default 256), ``max_length`` (default 2048: as
transformers' backend, a scored context keeps its last max_length + 1 tokens with the
continuation, a generation context its last max_length - max_gen_toks, and
``loglikelihood_rolling`` scores in windows of it); lm_eval's ``--batch_size`` (an integer) sets the rows
per decoding or scoring batch; lm_eval's ``max_batch_size`` and ``device`` are accepted and
ignored (devices are jax's).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import lm_eval.models  # noqa: F401  lm_eval's own models: it adds them only to an empty registry
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import chunks, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string

from mars_jax import config, decode, sources
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
        context and continuation tokens. Accepted tokens per decoding forward, over all
        ``generate_until`` calls so far, are logged, kept in ``tokens_per_forward`` and written into
    lm_eval's results (`get_model_info`).

        `from_args` raises FileNotFoundError for a workdir without a checkpoint and InputError for
        a bad model argument; ``generate_until`` InputError for an unsupported generation kwarg.
    """

    def __init__(
        self,
        opened: sources.Opened,
        options: DecodeOptions,
        *,
        seed: int = 0,
        max_gen_toks: int = 256,
        max_length: int = 2048,
        batch_size: int = 1,
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
        self.seed, self.max_gen_toks, self.max_length = seed, max_gen_toks, max_length
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
        max_length: int = 2048,
        batch_size: int | str | None = None,
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
        opened = sources.open(workdir, block_size=block_size, step=step)
        return cls(
            opened,
            options.replace(block_size=opened.block_size),
            seed=seed,
            max_gen_toks=max_gen_toks,
            max_length=max_length,
            batch_size=rows,
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
        """<|endoftext|>, the context of a request whose context is empty."""
        return self.tokenizer.bos_id

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
        kept for `tok_encode`: lm_eval hands the rendered string back as a context."""
        text = self.tokenizer.render_chat(chat_history, add_generation_prompt)
        self._rendered[text] = self.tokenizer.apply_chat_template(
            chat_history, add_generation_prompt
        )
        return text

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        """The token ids of ``string`` (no BOS/EOS added; written control tokens become ids),
        except a prefix rendered by `apply_chat_template`, whose ids are that chat's."""
        prefix = max((t for t in self._rendered if string.startswith(t)), key=len, default="")
        if not prefix:
            return self.tokenizer.encode(string)
        rest = string[len(prefix) :]
        return self._rendered[prefix] + (self.tokenizer.encode(rest) if rest else [])

    def _encode_request(self, i: int, context: str) -> list[int]:
        """The ids of request ``i``'s context (<|endoftext|> for an empty one). Raises
        ValueError naming the request, e.g. for a token outside a trimmed run's vocabulary."""
        try:
            return self.tok_encode(context) or [self.prefix_token_id]
        except ValueError as e:
            raise InputError(f"mars_jax: request {i}: {e}") from None

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
        """The log-probability of each request's text after <|endoftext|>, scored in windows of
        at most ``max_length`` tokens (lm_eval's rolling windows)."""
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
