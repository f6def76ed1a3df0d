"""``python -m vitexp.commands.rehearse_main <Hydra overrides>``: one row's rehearsal
(:mod:`vitexp.commands.rehearse`). A module of its own, so that Lightning's DDP workers, which rerun
``python -m <module> <arguments>``, run the same app."""

from vitexp.commands.cli import rehearse_main

if __name__ == "__main__":
    rehearse_main()
