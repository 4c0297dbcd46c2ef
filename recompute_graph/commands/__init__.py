"""The subcommands of ``recompute-graph`` other than ``solve``: one module each, each with
``add_parser(commands)`` (registers its argparse subparser and sets ``run``) and ``run(args) -> int``
(the exit status: 0 done, 1 infeasible budget, 2 error)."""
