"""The commands: ``toolkit-train``, ``toolkit-eval-lm``, ... (``setup.py``'s entry points).

A worker that ``toolkit-train``'s launcher spawns imports this package before anything else (it is how the
spawned interpreter finds the command's module): the first thing it does there is to die with the launcher
(``toolkit.distributed.parent_watch.stop_with_launcher``), so a launcher killed while its workers still import
torch leaves none behind.
"""

from toolkit.distributed.parent_watch import stop_with_launcher

stop_with_launcher()
