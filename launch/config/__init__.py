"""The job's configuration: the typed schemas (``schema``), the Hydra shell that composes
them (``shell``), and how a bad config is reported once, also under torchrun
(``bad_input``). The bottom room of the launcher: it imports no other."""
