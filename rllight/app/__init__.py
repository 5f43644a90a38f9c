"""The front desk: what stands between a person and a run. The ``rllight`` command (``cli``: ``RLLightCLI`` and the
subcommands; ``command_line``: its parser, help texts and one-line parse errors; ``usage``, ``versions``), the launch of
several processes (``launch``, ``launch_checks``), the precision and thread choices for this machine (``hardware``),
the progress lines (``progress``), ``rllight generate`` and ``chat`` (``generate``), and the records measurement tools
write (``records``). The core below (``rllight.module`` and the parts it composes) imports nothing from here."""
