r"""Export CLI: write a run's checkpoint as a Hugging Face directory.

  python -m mars_jax.export --workdir=runs/mars --output=hf_out [--step=N --dtype=bfloat16]

The directory (config.json, safetensors weights, tokenizer files with <|mask|> = 151665 and
the chat template) loads with ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer``, so a
MARS model serves anywhere an AR Qwen2.5 does (one-token mode needs no special decoder).
"""

from __future__ import annotations

from absl import app, flags, logging

from mars_jax import workdir as wd
from mars_jax.checkpoint import export_hf

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory.", required=True)
_OUTPUT = flags.DEFINE_string("output", None, "Output directory.", required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
_DTYPE = flags.DEFINE_string("dtype", None, "Weight dtype to save (default: param dtype).")


def main(argv):
    del argv
    wd.quiet_library_logs()
    model, tok, step = wd.load_model(_WORKDIR.value, step=_STEP.value)
    export_hf(model, _OUTPUT.value, dtype=_DTYPE.value)
    tok.save(_OUTPUT.value)
    logging.info("exported %s step %d to %s", _WORKDIR.value, step, _OUTPUT.value)


if __name__ == "__main__":
    app.run(main)
