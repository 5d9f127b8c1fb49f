"""One module per `kdump` command; each exposes `command`."""
