import sys

if sys.argv[1:2] == ["export"]:  # not a Trainer entry point: no LightningCLI subcommand (see cable_lightning.hf.export)
    from .hf.export import main

    main(sys.argv[2:])
else:
    from .cli import run

    run()
