from model_build.fetch import main

raise SystemExit(main())
