"""``python -m amp_doctor ...`` is ``amp-doctor ...``."""

from amp_doctor.cli import main

if __name__ == "__main__":
    main()
