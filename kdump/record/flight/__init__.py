"""The flight recorder (`mode="ring"`): the last calls of each process in a crash-proof journal.

`recorder` keeps them, with a call's layout and copy choice (`layout`), its device copy plan
(`plan`), graph-capture sites (`sites`), repeats of a call (`again`) and its last words
(`notes`); the journal is written by `journal` and read by `journal_reader` (its layout is
kdump.format.journal); static operands are `statics` / `statics_reader`; the device tier is
`devring` with its copies (`devcopy`, `devbatch`, `gather` with `snapshot.cu`, `cudrv`,
`pinned`, `devshare`); what a dead process left is salvaged by `salvage` (`salvage_device` for
the device side) and `salvager`, the process that holds the device tier, which `announce`
connects to the recorded processes.
"""
