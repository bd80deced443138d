"""The last import of a warm worker template (``template.warm_context``): the template ends at once.

A template only imports and forks: it holds no file to flush, no thread, no state anyone reads. Python's
ordinary exit of a process with torch loaded (torch's atexit handlers, then every module torn down) took
1.2 s of CPU on a 2-core machine, after the run it served had ended: beside whatever runs next, and with
the launcher's output pipes held open that long (whoever read ``oobleck-launch local``'s output to its
end waited for it). Registered after every other import of the template, this handler runs first when the
template exits (its agent or launcher gone: the forkserver's "alive" pipe at EOF) and ends the process.

The template's forks never run it: the standard library's forkserver ends each of them with ``os._exit``.
Nobody reads the template's exit status (``multiprocessing`` only asks whether it is alive), so 0 hides
nothing; what it printed is flushed first.
"""

import atexit

from oobleck_mm.lifetime import end_now

atexit.register(end_now, 0)
