from marscli.cli import main

if __name__ == "__main__":  # vLLM's engine spawns workers that re-import the main module
    main()
