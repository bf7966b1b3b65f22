"""Generate text from the command line, streaming it as it is produced.

python -m minfer.generate "The meaning of life is" --max-tokens 40
python -m minfer.generate --model ./my-checkpoint --temperature 0 "Hello"
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

from .engine.config import EngineConfig
from .assembly.llm import LLM
from .engine.sampling_params import SamplingParams
from .errors import BadSetting, InvalidParameter


def main(argv: list[str] | None = None, prog: str = "python -m minfer.generate") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("prompt", help="text to continue")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most (default: 32)")
    # Left out, these come from --generation-config (the checkpoint's generation_config.json), else the API's.
    by_default = "(default: the checkpoint's generation_config.json, else {})"
    parser.add_argument("--temperature", type=float, help="0 means greedy " + by_default.format("1.0"))
    parser.add_argument("--top-k", type=int, help="0 means off " + by_default.format("0"))
    parser.add_argument("--top-p", type=float, help=by_default.format("1.0"))
    # --model, --dtype, --seed (the engine's RNG, which this one unseeded request samples from), ...
    EngineConfig.add_cli_arguments(parser.add_argument_group("engine"), exclude=("max_num_seqs",))
    args = parser.parse_args(argv)
    undecodable = [c for c in args.prompt if "\udc80" <= c <= "\udcff"]  # bytes argv could not decode
    if undecodable:
        print(f"error: the prompt is not {sys.getfilesystemencoding()} text: byte 0x{ord(undecodable[0]) - 0xDC00:02x} "
              "does not decode", file=sys.stderr)
        return 2
    given = {name: getattr(args, name) for name in ("temperature", "top_k", "top_p") if getattr(args, name) is not None}
    try:  # a bad value is refused before the model loads, with argparse's status for a bad argument
        SamplingParams(max_tokens=args.max_tokens, **given)
        config = EngineConfig.from_cli_args(args, max_num_seqs=1)  # one request: a small KV cache
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        llm = LLM(config=config)
        params = replace(llm.get_default_sampling_params(), max_tokens=args.max_tokens, **given)
    except BadSetting as e:  # a flag this model cannot take: a bad flag still
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        request_id = llm.scheduler.add_request(args.prompt, sampling_params=params)
    except InvalidParameter as e:  # the prompt and flags ask more than the model holds: a bad argument, too
        print(f"error: {e}", file=sys.stderr)
        return 2
    # One request through the same engine the server uses: step, print the new text.
    scheduler = llm.scheduler
    try:
        sys.stdout.write(args.prompt)
        for _ in scheduler.steps():
            sys.stdout.write(scheduler.get_new_output(request_id).text)
            sys.stdout.flush()
        sys.stdout.write(scheduler.get_new_output(request_id).text + "\n")
        sys.stdout.flush()
    except KeyboardInterrupt:  # Ctrl-C ends the stream, as in any command: no traceback
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # or the exit's flush fails once more
        return 1
    scheduler.pop_response(request_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
