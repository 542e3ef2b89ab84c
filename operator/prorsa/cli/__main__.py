from prorsa.cli import main

main()
