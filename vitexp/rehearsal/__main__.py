"""``python -m vitexp.rehearsal <Hydra overrides>``: one row's rehearsal (:mod:`vitexp.rehearsal.app`).
A module of its own, so Lightning's DDP workers, which re-run ``python -m <module> <arguments>``,
run the same app."""
from vitexp.cli import rehearse_main

if __name__ == "__main__":
    rehearse_main()
