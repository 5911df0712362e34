"""Real text for the quality measurement: ordinary prose, a few hundred tokens each.

``CALIBRATION_TEXTS`` (``CALIBRATION_TEXT`` and ``CALIBRATION_MORE``, ~2,300 tokens) give the E8
codec its key means and key transforms; the ``PROMPTS`` are what quality is measured on, so
nothing is calibrated on what it is judged by.
``LONG_PROMPTS`` are three longer passages (1,599-2,018 tokens), on subjects of their own, for
the issue's setup (3 texts x 1,500 tokens; ``_quality.ISSUE_SETUP``): held out from calibration
like the ``PROMPTS``.
``QUESTIONS`` are short chat questions whose greedy answers, fp32 against a codec, are compared.
"""

from __future__ import annotations

__all__ = [
    "CALIBRATION_MORE",
    "CALIBRATION_TEXT",
    "CALIBRATION_TEXTS",
    "LONG_PROMPTS",
    "PROMPTS",
    "QUESTIONS",
]

QUESTIONS: tuple[str, ...] = (
    "What is the capital of France?",
    "Name three primary colours.",
    "Why do leaves change colour in autumn?",
    "How many days are there in a leap year?",
    "What does a baker do in the morning?",
    "Explain in one sentence what a harbour is.",
)

CALIBRATION_TEXT = """\
The harbour town wakes before the sun does. By five o'clock the bakers have already pulled the \
first trays of bread from their ovens, and the smell drifts down the narrow streets toward the \
water, where the fishing boats are coming back in with their nets folded on the decks. The \
fishermen do not talk much at that hour. They tie up, hand their crates to the men from the \
market, and stand for a while with their hands around paper cups of coffee, watching the light \
come up over the breakwater. Later in the morning the tourists arrive on the ferry from the \
mainland, with their cameras and their maps, and the town changes its face: the cafes put out \
their chairs, the shops raise their shutters, and the old women who sell lace set up their \
tables in the square. Most visitors stay only a day. They walk up the hill to the church, buy \
a postcard, eat grilled sardines at one of the restaurants by the quay, and catch the last \
ferry home. The few who stay longer discover a different place, quieter and slower, where the \
evenings are long and the conversations in the bars go on until the lights of the boats are \
the only thing left to look at on the water.
"""

CALIBRATION_MORE: tuple[str, ...] = (
    """\
The path to the upper lake leaves the village behind the sawmill and climbs through a forest \
of spruce and larch for the first two hours. It is a good path, wide and well drained, built \
long ago by the people who drove their cattle up to the summer pastures, and in places you can \
still see the flat stones they laid across the wettest ground. Above the tree line the country \
opens out. The grass is short and full of small flowers, blue gentians and yellow globe \
flowers and a pale orchid whose name I never manage to remember, and the marmots sit up on \
their rocks and whistle at you as you pass. We stopped at the old herders' hut to eat our \
lunch. The door was open and inside there was a table, two benches, a stove with a neat pile \
of wood beside it and a notebook in which walkers had written their names and the weather. \
Someone had drawn a very good picture of an ibex. The last part of the climb is steep, a \
zigzag of loose stones up the side of a moraine, and it was hot by then, so we went slowly \
and did not talk. Then the ground levelled, and there was the lake, perfectly still, with the \
glacier above it and the reflection of the glacier in it, and a wind so cold coming off the \
ice that we put our jackets back on within a minute. My brother took off his boots and put \
his feet in the water and lasted about four seconds. We sat on a rock for an hour and watched \
the clouds build over the pass. On the way down it started to rain, first a few large drops \
and then a steady soaking downpour, and we arrived back at the village wet through and very \
happy, and ate the biggest plates of potatoes and cheese the inn could bring us.
""",
    """\
A bicycle is one of the most efficient machines ever invented for turning human effort into \
movement. When you push on a pedal, the crank turns the chainring, and the chain carries that \
turning motion to a smaller sprocket on the rear wheel. Because the sprocket has fewer teeth \
than the chainring, the wheel turns several times for every turn of the pedals, and the gears \
let the rider choose how many. A low gear makes it easy to climb a hill but means pedalling \
quickly to go anywhere; a high gear covers more ground with each stroke but needs more force. \
The frame is usually a pair of triangles, a shape that stays rigid without much material, \
which is why a good frame can weigh less than a bag of flour and still carry a heavy rider. \
The wheels are held true by thin spokes under tension, each one pulling the rim towards the \
hub, so that the wheel is supported from above as much as from below. Tyres filled with air \
absorb the small bumps of the road and keep the rolling resistance low. Steering a bicycle is \
less obvious than it looks. To turn left, a rider first steers very slightly to the right, \
which makes the bicycle lean to the left, and then follows the lean around the corner. Most \
people do this without ever knowing it. Keeping a bicycle in good order takes little more \
than regular attention: keep the chain clean and lightly oiled, check the tyre pressure every \
week, make sure the brake pads have not worn down to the metal, and listen for new noises, \
which are almost always the first sign that something needs adjusting. A well looked after \
bicycle can last for decades.
""",
    """\
Dear Martin, thank you for your letter, which arrived on Tuesday with a very official stamp \
and a corner torn off by the postman's dog, who has opinions about envelopes. I was so glad \
to hear that the new job is going well and that you have found a flat with a balcony at last. \
You must send me a photograph of the tomatoes when they come. Things here are much as you left \
them. The river flooded again in March, not as badly as the last time, but enough to ruin the \
carpet in the bakery and to give everyone something to talk about for a month. The council \
has promised a new wall along the bank, and we will believe it when we see it. Your old \
teacher, Mrs Okafor, retired at Easter after thirty-one years at the school, and half the \
town came to the party in the hall. There were speeches, some of them far too long, and a \
cake in the shape of a blackboard, and at the end she stood up and said that she had only \
one piece of advice for all of us, which was to read more and to complain less, and then she \
sat down again to enormous applause. I have been trying to follow it. Your sister visited for \
a weekend in May with the children, who have grown so tall that I hardly recognised them. We \
took them to the coast and they built a sandcastle with a moat and a drawbridge made from a \
piece of driftwood, and they cried when the tide came in and washed it away, and then they \
laughed and built another one further up the beach. Write again soon and tell me everything. \
With love from all of us, and from the dog, who sends his apologies for the envelope.
""",
    """\
Before mechanical clocks, people measured the hours with whatever the world offered them. A \
stick in the ground casts a shadow that moves and shortens through the morning and lengthens \
again through the afternoon, and a sundial is only a careful version of that stick. At night \
and on cloudy days a sundial is useless, so people also measured time with water, letting it \
drip from one vessel into another through a small hole and marking the level at each hour. \
Candles with lines painted on them, and hourglasses filled with fine sand, did the same work \
in a smaller way. The first mechanical clocks appeared in the towers of European churches and \
town halls some seven hundred years ago. They were driven by a heavy weight on a rope, and \
their great difficulty was to make the weight fall slowly and evenly instead of all at once. \
The solution was the escapement, a small device that lets the gears move forward one tooth at \
a time, tick by tick. Those early clocks were not very accurate and often had no minute hand \
at all, but they changed how people lived: the day was now divided into equal hours that rang \
out across the town, and work, markets and prayers began to follow them. The pendulum, \
introduced in the seventeenth century, made clocks many times more accurate, because a \
pendulum of a given length swings at almost exactly the same rate whatever the size of its \
swing. Later came springs, which made clocks small enough to carry, and much later the quartz \
crystal and the atomic clock, which measures time by the vibrations of atoms and would lose \
less than a second in millions of years.
""",
    """\
"Are you sure this is the right road?" asked Lena, looking at the map upside down. "It says \
there should be a bridge." "There was a bridge," said her father. "I think that was the \
bridge." "That was a plank." "It was a small bridge." They drove on in silence for a while, \
between hedges so high that they could see nothing but the strip of grey sky overhead. A \
tractor came the other way and they had to reverse nearly half a mile to a gateway to let it \
pass, and the farmer raised one finger from the steering wheel in thanks, which Lena's father \
said was the local custom and was considered very friendly. "How much further?" "Not far." \
"You said that an hour ago." "And it was true then, too, in a general sort of way." At last \
the lane came out on top of a hill and there, below them, was the sea, wide and silver, with \
the little harbour and the white houses and the church with its crooked tower exactly as it \
had been in the photograph on the fridge at home. Lena stopped complaining at once. Her \
father stopped the car and they both got out and stood there in the wind. "Your grandfather \
was born in the third house from the end," he said. "The blue one. He used to say he could \
hear the boats from his bed." "Can we go and look at it?" "We can go and look at everything. \
We have a whole week." They got back into the car, and this time the road went straight down \
the hill to the harbour without a single wrong turn, which her father said proved that he \
had known the way all along.
""",
    """\
Plants make their own food from light, water and air, a process called photosynthesis. Inside \
the cells of a leaf are tiny green bodies called chloroplasts, and they contain chlorophyll, \
the pigment that gives leaves their colour. Chlorophyll absorbs red and blue light very well \
and reflects green light, which is why most plants look green to us. The energy of the \
absorbed light is used to split water molecules, which the plant has drawn up from the soil \
through its roots and stem. This releases oxygen, which escapes from the leaf through small \
pores on its underside, and it provides the energy to take carbon dioxide from the air and \
build it into sugar. The plant uses that sugar in two ways: it burns some of it to power its \
own growth and repair, and it turns the rest into starch and cellulose, which it stores or \
builds into new stems, leaves and roots. Almost every living thing on land depends on this \
process, directly or indirectly. Animals that eat plants take in the energy that the plants \
captured from sunlight, and animals that eat other animals take it in at one more remove. \
The oxygen we breathe was put into the atmosphere, over hundreds of millions of years, by \
plants and by the tiny organisms in the sea that do the same thing. In autumn, many trees \
stop making chlorophyll as the days grow shorter and colder. The green fades, and the yellow \
and orange pigments that were in the leaves all along become visible, while some trees also \
produce new red pigments before the leaves fall. A gardener who understands all this knows \
why plants need light, why they wilt without water, and why a crowded seedling grows tall \
and thin as it stretches towards the sun.
""",
)
"""More text for the E8 key transform (``_quality.calibrate``), written for it: a walk, how a
bicycle works, a letter, a history of clocks, a dialogue, photosynthesis -- none of it the
``PROMPTS``' subjects, so the scored prompts stay held out."""
CALIBRATION_TEXTS: tuple[str, ...] = (CALIBRATION_TEXT, *CALIBRATION_MORE)
"""Every calibration passage, each run through the model on its own (positions from 0)."""

PROMPTS: tuple[str, ...] = (
    """\
When my grandmother moved out of the farmhouse she had lived in for almost sixty years, the \
family gathered for a weekend to help her sort through what she wanted to keep. It was harder \
than any of us expected. Every drawer held something that started a story: a ribbon from a \
county fair in a year nobody could remember, a bundle of letters from a cousin who had \
emigrated to Canada, a tin of buttons that she insisted were worth saving because you never \
know when you will need a button. My uncle wanted to be efficient about it. He brought a stack \
of cardboard boxes and a roll of tape and a marker, and he labelled the boxes keep, give away \
and throw out before anyone had opened a single cupboard. By the end of the first afternoon \
the keep box was overflowing and the other two were almost empty, and he had stopped trying \
to hurry anybody. We ate dinner at the long kitchen table for what we all understood was the \
last time. Somebody found an old photograph of the same table, taken at a harvest supper when \
my mother was a little girl, and we passed it around and tried to name everyone in it. My \
grandmother knew them all. She told us who had married whom, who had moved to the city, who \
had been the best dancer in the valley and who had fallen off the hay wagon and broken an arm \
the summer the photograph was taken. Later, when the dishes were done, she walked out onto \
the porch and stood looking at the fields for a long time. I went out to stand with her. She \
said that the hardest part was not leaving the house but leaving the view, because she had \
watched those fields change colour with every season of her adult life, and she did not know \
what she would look at now. Then she laughed and said that at least the new apartment had a \
window facing the park, and that she intended to learn the names of every dog that walked \
past it. The next morning we loaded the car, and she did not look back as we drove away, \
although I saw her hand tighten on the strap of her bag when we passed the mailbox at the end \
of the lane. She has lived in the apartment for three years now. She knows the dogs.
""",
    """\
The public library in our neighbourhood is a plain brick building that most people walk past \
without noticing, but on a weekday afternoon it is one of the busiest places in the city. \
Students come after school to do their homework at the long tables, because the library is \
quiet and warm and has reliable internet, which many of them do not have at home. Retired \
people read the newspapers in the armchairs by the window, and some of them have been sitting \
in the same chairs at the same hour for so many years that the staff greet them by name. \
Parents bring small children to the story hour on Tuesdays and Thursdays, where a librarian \
with a remarkable range of voices reads picture books to a circle of toddlers who are only \
sometimes paying attention. There are people looking for jobs, filling in applications on the \
public computers and asking for help with their resumes. There are people who have nowhere \
else to go during the day, and the library lets them stay, as long as they follow the same \
rules as everyone else. The librarians do much more than lend books. They help people fill in \
tax forms, find information about housing and health care, learn to use email, and track \
down obscure facts for curious patrons who have been arguing about something with a friend. \
One of them told me that the most common question she hears is not about books at all but \
about how to print a document from a phone. Another said that the part of the job she finds \
most rewarding is watching a child who arrived at the library unable to read come back a year \
later to borrow chapter books on her own. Funding for the library has been cut several times \
over the past decade, and the opening hours are shorter than they used to be. Every few years \
there is a proposal to close it and move its services online, and every time the \
neighbourhood turns out to the council meeting to object. The people who speak at those \
meetings rarely talk about books. They talk about a place where anyone can go, for free, \
without being asked to buy anything or explain why they are there.
""",
    """\
Learning to cook as an adult is a humbling experience. I grew up in a household where meals \
simply appeared, and by the time I left home I could make toast, boil pasta and not much \
else. For years I lived on sandwiches, takeaway and whatever was on offer in the office \
canteen. What finally changed my habits was not a New Year's resolution but a broken leg. \
Stuck at home for six weeks, bored and tired of delivery food, I started watching cooking \
videos and then, cautiously, trying the simplest recipes. The first few attempts were not \
good. I burned the onions because I did not understand that the heat needed to be lower, \
and I added salt at the end instead of throughout, so everything tasted flat. A friend who \
cooks well came round one evening and watched me chop a carrot, and then very gently took the \
knife out of my hand and showed me how to hold it. That small lesson made more difference \
than any recipe. Once I could chop quickly and safely, cooking stopped feeling like a chore \
and started to feel like something closer to a craft. I learned to taste as I went, to \
trust my nose, and to keep a few basic ingredients in the cupboard so that I could put \
together a meal without a special trip to the shop. I learned that most dishes are built on \
a small number of techniques, and that once you understand how to brown meat, soften \
vegetables and make a simple sauce, you can cook a surprising variety of things. My leg \
healed long ago, but I still cook most evenings. It has become the part of the day when I \
put my phone away and think about nothing except what is in front of me. There is a real \
pleasure in turning a bag of groceries into a meal, and an even greater one in feeding other \
people. I have started inviting friends round on Sundays, and although the food is not always \
a success, nobody has complained yet. Last month I made bread for the first time. It was \
dense and slightly lopsided, and I have never been prouder of anything I have made.
""",
)

LONG_PROMPTS: tuple[str, ...] = (
    """\
My neighbour Tomas has kept bees for thirty years, and when I told him last spring that I \
wanted to try it myself, he laughed and said that the bees would teach me patience whether I \
wanted to learn it or not. He was right. I have now kept two hives through a whole year, and I \
have learned more about weather, flowers and my own impatience than I ever expected to learn \
from a box of insects at the bottom of the garden.

The first thing Tomas made me do was read. Before I bought a single piece of equipment, he \
lent me three old books with broken spines and pencil notes in the margins, and he told me to \
come back when I could explain to him what a colony does in each month of the year. It seemed \
like a strange test at the time, but it made sense later. A beekeeper who does not know what \
the bees are trying to do in a given season will always be working against them, opening the \
hive at the wrong moment, adding space when they need warmth, or taking honey they cannot \
spare. The colony is not a machine that produces honey. It is a single living thing made of \
many thousands of bodies, and its whole year is a careful plan for surviving the next winter.

In the early spring the colony is small. The workers that were born in the autumn have lived \
through the cold months by clustering together on the comb, shivering their flight muscles to \
make heat, and slowly eating the stores they put away in the summer. By March many of them are \
old and worn out. The queen starts to lay again as the days grow longer, a few eggs at first \
and then more and more, and the colony has to balance two needs that pull against each other. \
It must raise new bees quickly, because the old ones are dying, but every new larva has to be \
fed and kept warm, and the cluster can only cover so much comb on a cold night. If the queen \
lays too fast and a late frost arrives, the workers may be forced to abandon part of the \
brood. Watching a colony in March, Tomas told me, is like watching someone cross a frozen \
river: you want to help, but the best thing you can usually do is stay out of the way.

My bees arrived in April, in a small wooden box with five frames of comb, a few thousand \
workers and a marked queen with a white dot of paint on her back. I had built the hives myself \
over the winter from a kit, and I had painted them a pale green that my daughter chose. Tomas \
came over on the day they arrived to help me move them into their new home. He lit the smoker \
with dry grass and a handful of wood shavings, and he showed me how to puff a little cool \
smoke at the entrance and wait a minute before lifting the lid. The smoke does not put the \
bees to sleep, as many people believe. It masks the alarm scent that guard bees release when \
they sense danger, and it makes the bees fill themselves with honey, as if they were preparing \
to leave a burning tree. A bee with a full stomach is calm and slow and much less likely to \
sting.

I was nervous that first day, and I am sure the bees could tell. My hands shook as I lifted \
the frames one by one and set them into the new box, and I moved too quickly, and a few bees \
found their way up the sleeve of my suit. Tomas moved slowly and spoke softly the whole time, \
as if he were in a library, and he never once seemed to hurry. When we had closed the hive, he \
told me that the most important piece of equipment a beekeeper owns is not the veil or the \
gloves or the smoker but a slow pair of hands.

May was the month when I began to understand why people fall in love with this hobby. The \
fruit trees in the gardens along our street came into blossom, then the dandelions in the \
fields behind the houses, then the hawthorn in the hedges, and the colonies grew at a speed \
that was almost alarming. Every week when I opened the hives there were more frames covered \
with bees, more cells of sealed brood, and the bright patches of pollen that the foragers had \
packed into cells around the edges of the brood nest: orange from the dandelions, pale yellow \
from the fruit trees, and a strange dark grey that Tomas said came from the horse chestnuts. I \
started keeping a notebook, writing down the date, the weather, what I saw in each box and \
what I did. Tomas had insisted on this as well. Memory, he said, is a poor beekeeper, because \
it remembers the good days and forgets the reasons for the bad ones.

The great danger of late spring is swarming. When a colony becomes strong and crowded, it \
raises new queens in special cells that hang down from the comb like peanuts, and just before \
the first of them hatches, the old queen leaves with about half of the workers to find a new \
home. For the bees this is how the species spreads, and it is a sign of a healthy colony. For \
the beekeeper it means losing half the workforce at the very moment the summer flowers are \
about to open. I lost a swarm in early June, despite everything I had read. I had been away \
for a long weekend, and when I came back the stronger of my two hives was suddenly quiet, and \
there were five opened queen cells on the frames. I found the swarm two days later, hanging \
like a dark brown bag from a branch of the apple tree in the garden next door. Tomas helped me \
shake it into a cardboard box and carry it to an empty hive, and so, by accident, I ended the \
spring with three colonies instead of two.

Summer is the season of the main honey flow, and its timing depends on the landscape. In our \
area it comes from lime trees in July and from the clover and the blackberry flowers along the \
edges of the fields. During a strong flow the foragers fly from first light until dusk, and \
the hive hums in the evening as thousands of bees fan their wings to drive water out of the \
nectar. Nectar is mostly water when it is collected, and the bees have to reduce it until it \
is thick enough to keep without spoiling. Only then do they cover the cells with a thin cap of \
white wax. A beekeeper learns to read the frames by their weight and colour: light and \
glistening when the nectar is fresh, heavier and duller as it thickens, and finally sealed and \
ready.

The weather in July was unkind. We had two weeks of rain just as the lime trees were \
flowering, and the bees spent those days inside eating the stores they had gathered in June. I \
remember standing at the kitchen window watching the rain and feeling, for the first time, the \
particular helplessness that every farmer knows. There is nothing to do when the weather is \
wrong except wait and hope. When the sun came back, the flow was almost over, but the clover \
was still good, and in the last days of the month the supers began to fill.

I took my first honey in August. Tomas lent me his extractor, a steel drum with a basket \
inside that spins the frames so that the honey is thrown out of the cells by force, and we set \
it up in my garage with the door closed so that the bees would not find us. First we cut the \
wax caps off with a warm knife, then we loaded the frames, turned the handle, and listened to \
the honey begin to patter against the wall of the drum like rain on a tin roof. It ran out of \
the tap at the bottom in a thick golden rope, and the whole garage smelled of flowers and warm \
wax. From the two older hives we took about thirty kilograms. I gave jars to half the street, \
and I still have more in the cupboard than my family can eat.

After the harvest the year turns. The flowers become fewer, the drones are pushed out of the \
hive by the workers because they are no longer needed, and the colony begins to prepare for \
winter. The bees born in the autumn are different from the summer ones: they have larger fat \
bodies and can live for months rather than weeks. A beekeeper must make sure each colony goes \
into the cold with enough stores, usually by feeding sugar syrup in September, and with a \
healthy population. It is also the time to check for mites, which are the most serious threat \
to honey bees in most of the world today. I treated all three hives in late summer and counted \
the mites that fell onto a sheet of white card under each hive. The numbers were low, and I \
was relieved.

By November the hives were quiet. On mild days a few bees flew out to relieve themselves or to \
carry away the dead, but most of the colony stayed inside in its tight winter ball. I fitted \
mouse guards across the entrances, put a heavy stone on each roof against the winter storms, \
and then there was nothing left to do but wait. Once a month I walked down the garden and \
pressed my ear against the side of each box. If you listen carefully on a cold day, you can \
hear a faint, steady hum, the sound of a colony keeping itself alive.

Now it is February, and all three colonies are still alive. I know that many things can go \
wrong before the spring, and I try not to count my bees before the dandelions bloom. But I \
have learned the thing Tomas wanted me to learn. A hive is not something you control. It is \
something you look after, carefully and slowly, while it goes about the business it has been \
doing for millions of years, and the best beekeepers are not the ones who do the most but the \
ones who understand what not to do.
""",
    """\
Every evening, a few minutes before the news ends, someone stands in front of a map and tells \
millions of people whether they will need an umbrella tomorrow. It looks simple, and it takes \
less than two minutes, but behind those two minutes is one of the largest scientific efforts \
that human beings have ever organised. A weather forecast is the result of measurements taken \
all over the planet, sent around the world in a matter of minutes, and fed into some of the \
most powerful computers ever built. It is worth understanding how it works, if only to know \
when to trust it and when to keep a coat in the car anyway.

The first step is observation. At thousands of weather stations on land, instruments record \
the temperature, the pressure of the air, the humidity, the speed and direction of the wind, \
and the amount of rain that has fallen. Some of these stations are staffed by people who have \
read the same thermometers at the same hours for decades; most are now automatic and send \
their readings without anyone touching them. At sea, ships and floating buoys do the same \
work, and on the ocean floor and at the surface there are instruments that measure the \
temperature of the water, which matters a great deal, because the oceans store far more heat \
than the air does and release it slowly over weeks and months.

Measurements at the surface are not enough, because weather happens in three dimensions. Twice \
a day, at the same moment all over the world, meteorologists release balloons filled with \
hydrogen or helium that carry a small package of instruments up through the atmosphere. As the \
balloon rises, the package radios back the temperature, the humidity and the pressure, and by \
tracking its position the forecasters learn the wind at every height. The balloon climbs for \
about an hour and a half, expanding as the air around it grows thinner, until it bursts \
somewhere above twenty kilometres and the instruments fall back to the ground on a small \
parachute. Most of them are never found again. Commercial aircraft add many more measurements, \
reporting the wind and the temperature along their routes as they climb, cruise and descend.

Then there are the satellites. Some of them sit high above the equator, turning with the Earth \
so that they always look down on the same half of the planet, and they send back a new picture \
every few minutes. These are the images of swirling clouds that appear behind the presenter on \
the evening news. Others fly much lower, in orbits that pass over the poles, and they measure \
the radiation that comes up from the atmosphere at many different wavelengths. From those \
measurements, with a great deal of careful mathematics, it is possible to work out the \
temperature and moisture of the air at different heights, even over the middle of the ocean \
where there are no balloons and no ships.

All of this information arrives at the major forecasting centres within a few hours, and the \
second step begins: building a picture of the atmosphere as it is right now. This is harder \
than it sounds. The measurements are scattered unevenly, dense over Europe and North America \
and sparse over the southern oceans and the deserts. Each instrument has its own errors, and \
some readings are simply wrong, because a sensor has failed or a message has been garbled. The \
forecasting system has to combine everything into a single consistent description of the whole \
atmosphere, filling the gaps in a way that respects the laws of physics. It does this by \
starting from the previous forecast, which already gives a reasonable guess of the present \
state, and then nudging that guess toward the new observations, trusting each one according to \
how reliable it is known to be. The result is called the analysis, and it is the starting \
point for everything that follows.

The third step is the forecast itself. The atmosphere is a fluid, and its behaviour is \
described by a set of equations that were written down more than a century ago: equations for \
how air moves when it is pushed by differences in pressure, how it warms and cools as it rises \
and sinks, and how water changes from vapour to cloud to rain and back again. These equations \
cannot be solved with pen and paper for a real atmosphere. Instead, the computer divides the \
air into a grid of boxes, a few kilometres wide and stacked in many layers from the ground to \
the edge of space, and it calculates how the conditions in each box will change over a short \
step of time, perhaps a few minutes, based on its neighbours. Then it takes another step, and \
another, thousands of times, until it has reached several days into the future.

Some of the most important things in the weather are smaller than a single box. A summer \
thunderstorm may be only a few kilometres across, and the individual clouds that make up a sky \
full of cumulus are smaller still. The model cannot see them directly, so it has to estimate \
their combined effect from the conditions in the box, using rules that scientists have \
developed from observations and from detailed studies of small areas. Getting these rules \
right is one of the main reasons forecasts have improved, and it is also one of the main \
reasons they still go wrong.

There is a deeper limit as well. In the nineteen sixties a meteorologist running a simple \
weather model on an early computer noticed that when he restarted a calculation from rounded \
numbers, the new forecast soon drifted away from the old one and eventually looked nothing \
like it. Tiny differences at the start grew until they dominated the result. This sensitivity \
is built into the atmosphere itself, not just into the computer. No matter how good our \
instruments become, there will always be small errors in the starting picture, and those \
errors will always grow. Beyond about two weeks, the detailed weather on a particular day \
cannot be predicted at all.

Forecasters have learned to live with this limit by running not one forecast but many. They \
take the best analysis, make dozens of slightly different copies of it, each changed by an \
amount similar to the uncertainty in the measurements, and run the model forward from every \
copy. If the forecasts all agree, the weather is in a predictable mood and the forecaster can \
speak with confidence. If they spread out in every direction, the forecaster knows that \
tomorrow is genuinely uncertain. This collection of forecasts is called an ensemble, and it is \
where the percentages in a forecast come from. A seventy per cent chance of rain means, \
roughly, that rain fell at your location in seventy out of every hundred similar situations \
the system considered.

The final step is the human one. The computer output is enormous, and much of it is not in a \
form anyone can use. Forecasters look at the results from several different models, compare \
them with what is actually happening on the radar and the satellite images, and use their \
knowledge of local conditions to decide what to say. They know that fog tends to linger in a \
particular valley, that a certain wind brings snow to one side of the hills and clear skies to \
the other, and that the model always makes the sea breeze arrive an hour too early in spring. \
Their job is to turn millions of numbers into a few sentences that help people make decisions: \
whether to cut the hay today or wait until next week, whether to send the gritting lorries out \
tonight, whether to cancel the outdoor concert.

Forecasts today are remarkably good. A forecast for five days ahead is now about as accurate \
as a forecast for one day ahead was forty years ago, and the improvement continues, slowly and \
steadily, year after year. That progress rarely makes the news, because a correct forecast is \
invisible: nobody remembers the day it rained exactly when they were told it would. But the \
next time you look out of the window in the morning and decide to take an umbrella, it is \
worth remembering the balloons rising in the dark over distant islands, the satellites turning \
quietly overhead, and the long chain of people and machines that made that small decision \
possible.
""",
    """\
The choir met on Wednesday evenings in the hall behind the old school, a long room with a \
wooden floor, tall windows and a piano that had been tuned so many times that the tuner joked \
it was held together by habit. There were thirty-one of us that autumn, if everyone came, \
which they never did. We were teachers and nurses, a bus driver, two retired engineers, a \
woman who ran the flower shop on the corner, a few students from the college, and a man named \
Arthur who was eighty-four and had sung in the choir since before most of us were born. None \
of us were professionals. Some of us could read music well, and some of us could read it only \
in the sense that we could tell whether the notes were going up or down.

Our conductor was a young woman called Nadia, who had taken over the choir in the summer when \
the previous conductor retired. She was small and quick and she laughed easily, and on her \
first evening she told us that she had a plan. In December, she said, we were going to sing a \
real concert in the cathedral in town, with an orchestra, in front of an audience that had \
paid for tickets. There was a long silence. The choir had not sung outside the hall in years \
except at the summer fair, where nobody listened very carefully because they were queueing for \
cake. Arthur was the first to speak. He said that he had been waiting a long time for someone \
to say something like that, and that he intended to live long enough to do it. Everybody \
laughed, and after that nobody argued.

The piece Nadia chose was a setting of old winter carols for choir and strings, written about \
fifty years ago by a composer none of us had heard of. It was about forty minutes long, and in \
places it divided into eight parts, which meant that for a few bars at a time the sopranos, \
the altos, the tenors and the basses each split into two groups singing different notes. When \
she handed out the scores, the bus driver turned the pages slowly, looking at the black \
clusters of notes, and said that it looked like a flock of starlings had landed on a telephone \
wire. That became our name for the difficult passages. Whenever we reached one, somebody would \
mutter that the starlings were coming, and we would all take a deep breath.

The first rehearsals were difficult. Nadia started by teaching each section its notes \
separately, while the others waited, and the waiting was long and sometimes boring. The \
tenors, of whom there were only four, had the hardest job, because the composer had given them \
a high line in the second carol that climbed and climbed and then held a long note just at the \
top of their range. The first time they tried it, one of them went silent halfway up, one went \
flat, and the other two arrived at the top note looking as if they had run up a hill. Nadia \
did not laugh at them. She made them sing it quietly, then more quietly still, until they were \
almost whispering, and she explained that a high note sung softly with a relaxed throat is \
easier than one that is shouted. By the fourth week they could sing it, and by the sixth week \
they sang it beautifully, and they were very proud of themselves.

What surprised me most was how much of the work had nothing to do with the notes. Nadia spent \
a whole evening on the words. She made us read the text of each carol aloud, like a poem, \
without singing, and she asked us what it meant and who was speaking. One of the carols was a \
conversation between a traveller and an innkeeper on a cold night, and she wanted the sopranos \
to sound tired and the basses to sound suspicious, and she made us practise the same four \
lines a dozen times until we understood that singing a word and meaning it are two different \
things. Another evening she spent entirely on breathing. We lay on our backs on the wooden \
floor with books on our stomachs, watching them rise and fall, while she walked between us and \
told us to breathe low and slow. Arthur said it was the first time in sixty years that a \
conductor had asked him to lie down during a rehearsal, and that he approved.

In November, the work became serious. We added a second rehearsal on Sunday afternoons, and \
Nadia began to record us on her phone and play the recordings back at the end of each session. \
This was painful. A choir sounds very different from inside than from outside. Standing in the \
middle of the altos, I had thought we were doing rather well, but the recording showed that we \
were always slightly behind the beat at the start of each phrase, that the basses sang the \
long notes with a wobble, and that nobody, in any section, was pronouncing the ends of the \
words. Nadia said that choirs always swallow their final consonants and that an audience in a \
big stone building will hear only vowels unless we spit the consonants out like cherry stones. \
For a week we rehearsed with exaggerated t's and d's and k's, and it sounded ridiculous in the \
hall, but on the next recording we could understand every word.

There were setbacks. In the middle of November a cold went through the choir, and for two \
weeks about a third of us were either absent or croaking. The flower shop owner broke her \
wrist slipping on wet leaves and had to hold her music in one hand. One of the students left \
because she had exams. And the orchestra, which we had not yet met, sent word that they could \
only rehearse with us once, on the afternoon of the concert itself. Nadia admitted, for the \
first time, that she was worried. But she did not let us see it for long. She said that \
professional choirs often have only one rehearsal with the orchestra, and that we would simply \
have to know the music so well that nothing could surprise us.

The last Wednesday rehearsal before the concert was the best we ever had. Something had \
changed without any of us noticing exactly when. We no longer watched our scores; we watched \
Nadia. When she raised her hand slightly, we sang more softly, and when she leaned forward, we \
pressed on. The starlings came and went, and we barely noticed them. At the end of the final \
carol there is a long, quiet chord, held by all eight parts, that fades until it disappears, \
and that evening it disappeared so gradually that none of us could say when the sound had \
stopped. For a few seconds nobody moved. Then Arthur said, quite loudly, that he could die \
happy now, and Nadia told him that he was not allowed to until after Saturday.

The cathedral was cold on the afternoon of the concert, and enormous. Our voices, which had \
filled the little hall, seemed to vanish into the high stone roof. The orchestra was friendly \
and very good, and the rehearsal with them went faster than we expected, but hearing the \
strings for the first time was confusing, because the notes we had always taken from the piano \
were now hidden among the violins and cellos, and twice the tenors came in a bar early. Nadia \
stopped, smiled, and told us to listen for the cellos instead of the piano. The third time it \
was right.

By the evening the cathedral was full. I could see my family in the fourth row, and the bus \
driver's grandchildren waving from the side aisle, and people from the town I had never seen \
before. When we stood up, my knees were shaking. Then Nadia lifted her hands, the strings \
began, and after the first phrase the nerves went away, because there was simply no room left \
for them. I do not remember much of the concert in detail. I remember the tenors' high note \
ringing out into the roof, clear and soft, exactly as they had practised it. I remember the \
traveller and the innkeeper, and an old man in the front row laughing at the innkeeper's \
reply. And I remember the last chord, fading into the cold air of that huge building, and the \
long silence before the applause began.

Afterwards, in the crowded porch, Arthur shook every one of our hands. He said that in sixty \
years of singing he had never been part of anything quite like it. The choir still meets on \
Wednesday evenings in the hall behind the old school. There are thirty-eight of us now, and in \
the spring we are going to try something even harder.
""",
)
"""Three longer passages (a year of beekeeping, how a weather forecast is made, a choir's
concert; each >= 1,550 tokens), for issue 14's own setup: 3 texts x 1,500 tokens, no window.
Their subjects are neither the calibration texts' nor the ``PROMPTS'``."""
