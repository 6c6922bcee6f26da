"""What every study shares: the measuring core, interleaved rounds, statistics, the
comm limit, tables and docs sections, plots, command-line flags, torchrun relaunch and
device placement. Nothing is imported here, so a study loads only what it uses."""
