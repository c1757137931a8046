from marscli.cli import main

main()
