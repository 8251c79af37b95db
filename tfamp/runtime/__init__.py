"""Running rewritten graphs: ``tfamp.function`` and the ``TFAMP_ENABLE=1`` start-up hook."""
