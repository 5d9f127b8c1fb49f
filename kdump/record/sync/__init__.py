"""The sync recorder: inputs snapshot before the call, outputs after it, one bundle per dumped call
(`recorder`), with its exact-repeat path for small calls made again (`repeat`)."""
