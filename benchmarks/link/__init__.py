"""The simulated slow link: ``shaping`` (a comm hook that holds each bucket for its
wire time), ``netns`` (a real shaped network namespace) and ``peer_hooks`` (PyTorch's
compression hooks, measured as peers). Nothing is imported here."""
