"""``python -m dpclip``: the same program as the ``dpclip`` command (``dpclip.cli.entry``).

Like the console script, it re-executes once under jemalloc when that is installed
(``dpclip.runtime``; the command line, ``-m dpclip`` included, is kept).
"""

from dpclip.cli import entry

if __name__ == "__main__":
    entry()
