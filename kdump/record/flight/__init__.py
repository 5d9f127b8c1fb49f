"""The flight recorder (`mode="ring"`): the last calls of each process in a crash-proof journal
(`journal`), kept by `recorder`; static operands (`statics`); the device tier and its copies
(`devring`, `devcopy`, `gather` with `snapshot.cu`); salvage of what a dead process left
(`salvage`, and `salvager`, the process that holds the device tier)."""
