from actcfg.cli import main

raise SystemExit(main())
