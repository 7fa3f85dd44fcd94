from memguard.cli import main

raise SystemExit(main())
