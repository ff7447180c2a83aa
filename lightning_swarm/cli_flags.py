"""One flag style for the command lines: kebab-case (``--run-id``); old snake_case spellings still work, with a
warning, for one release."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import List, Optional, Sequence


class KebabCaseArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser that also accepts ``--snake_case`` for each ``--kebab-case`` option, with a
    FutureWarning naming the new spelling. Options are declared in kebab-case; ``args.run_id`` as usual."""

    def parse_known_args(self, args: Optional[Sequence[str]] = None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self.rewrite_snake_case(args), namespace)

    def rewrite_snake_case(self, args: List[str]) -> List[str]:
        """``args`` with every old ``--snake_case`` spelling of a known ``--kebab-case`` option replaced."""
        known = set(self._option_string_actions)
        rewritten = []
        for arg in args:
            if arg == "--":  # the rest are positional values
                rewritten.extend(args[len(rewritten):])
                break
            flag, equals, value = arg.partition("=")
            kebab = flag.replace("_", "-")
            if flag.startswith("--") and "_" in flag and flag not in known and kebab in known:
                warnings.warn(f"{flag} is deprecated, use {kebab} (the old spelling goes away in the next release)",
                              FutureWarning, stacklevel=3)
                arg = kebab + equals + value
            rewritten.append(arg)
        return rewritten
