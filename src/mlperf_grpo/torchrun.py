"""``python -m mlperf_grpo.torchrun ARGS``: torchrun (``torch.distributed.run``, the
same arguments) ending with the CLI's exit codes instead of a traceback.

On Ctrl-C or SIGTERM torchrun's agent forwards the signal to the ranks, waits for them
(each prints its one ``mlperf-grpo:`` line; rank 0 publishes the checkpoints in flight
and prints the note on how to finish the run), then raises its ``SignalException``: a
traceback and exit 1. Here that ends quietly with 130 (SIGINT) or 143 (SIGTERM), 128 +
the signal number as a shell reports it (README, "The CLI"). A failed rank
(``ChildFailedError``) ends with torchrun's failure summary, without the traceback, and
the first failed rank's exit code (2 bad input, 3 aborted, 128 + N for a rank killed by
signal N).
"""

from __future__ import annotations

import sys


def exit_code_of_failure(exitcode: int) -> int:
    """A rank's exit code as a shell reports it: ``-N`` (killed by signal N, as
    ``subprocess`` gives it) -> ``128 + N``; any other code unchanged."""
    return 128 - exitcode if exitcode < 0 else exitcode


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default: ``sys.argv[1:]``); returns the exit code.

    Returns:
        0 when every rank succeeded; 128 + the signal number when torchrun was stopped
        by one (SIGINT: 130, SIGTERM: 143); else the first failed rank's code
        (:func:`exit_code_of_failure`), after torchrun's failure summary on stderr.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except SignalException as err:  # the ranks got the signal too and printed their lines
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        sys.stderr.write(f"{err}\n")
        sys.stderr.flush()
        return exit_code_of_failure(err.get_first_failure()[1].exitcode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
